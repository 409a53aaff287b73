"""Training checkpoints: one package for how they are laid out, written and read.

  layout.py        folder and file names, the step-folder pattern, listing and pruning
  commit.py        the atomic commit: temporary folder -> fsync -> rename, meta.json last
  verify.py        reading meta.json back, and refusing a checkpoint edited after it was written
  rng.py           each process's random number generator states, without pickles
  dcp.py           sharded weights and optimizer state (torch.distributed.checkpoint), read
                   through an allow-list so that nothing in a checkpoint is unpickled
  identity.py      what makes a checkpoint this run's (the run identity, resumable config keys)
  checkpointer.py  the Checkpointer: holds a run's stateful parts; save(step, meta), load(path)
  source.py        a checkpoint read as a source of weights outside training (export)

Deciding *whether* a run resumes, and from which checkpoint, is the trainer's policy
(keel.train.resume); this package only says what a checkpoint is and whether it is intact.
"""
