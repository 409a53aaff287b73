"""Process groups, launching, data/fully-sharded parallelism, and gathering
sharded weights (checkpoints are keel.checkpoint's).

Nothing here imports keel.train, keel.data or keel.cli: the training loop calls into this
package, never the other way round. Import the submodules directly.
"""
