"""The store-node daemon: a process that contributes memory to the pool (`daemon`)."""
