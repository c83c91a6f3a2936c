from replicator.cli import run

run()
