"""The `kvpool` command line. Each subcommand lives in its own module with a `register` function."""
