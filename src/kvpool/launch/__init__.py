"""The one place kvpool starts child processes (nothing else in the library calls
`subprocess.Popen`; tests/launch/test_structure.py keeps it so; benchmarks in kvpool.bench
start their own measured programs).

    ports      a free port for a child; the ports a launcher was told to use, checked
    children   a child that dies with its parent; `Command`, `spawn_command`, `spawn` (kvpool
               ARGS), `running`; stopping one or its process group
    ready      readiness announced by the child: a line on a pipe (`--ready-fd`)
    wait       the one polling wait (`wait_for`) for what cannot announce: a port, an HTTP
               server, the master's mounted segments
    table      a launcher's named children (`ChildTable`): started, restarted, waited for,
               stopped a group at a time
    etcd       etcd's one command line, and an etcd server that can be killed and restarted
    store      store processes for the fault tests and benchmarks: masters, store nodes, an
               HA pair on etcd
    netns      emulated hosts: network namespaces on a bridge, each with its own /dev/shm

Policy (which processes a cluster has, on which ports and hosts) is the callers':
kvpool.serve.launch (`kvpool up`), kvpool.serve.hosts (`kvpool up --hosts`), the CLI's
store-only cluster, the benchmarks and the tests.
"""
