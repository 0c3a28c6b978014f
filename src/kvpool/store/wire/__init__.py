"""The store's wire: what clients and the master say to each other, in one place.

Sans-I/O: result codes and typed results (`codes`), the request/reply messages (`protocol`),
length-prefixed frames (`framing`), the token handshake (`auth`), key and size validation
(`validate`) and the HA leader record in etcd (`leader`). Both sides import this package;
the client never imports master code.
"""
