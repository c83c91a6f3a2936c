from replicator.trainer.cli import run

run()
