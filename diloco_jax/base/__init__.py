"""What every layer of the package shares and nothing of it depends on: the parallel axes'
names, the per-replica random keys, the optional packages' one-line errors, the config error,
the command lines' parser, who may talk to a server, and the progress bar."""
