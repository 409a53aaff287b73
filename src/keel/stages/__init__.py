"""Training stages (pt, sft, dpo, orpo, simpo, kto): one module per stage, one registry.

Every other package asks `keel.stages.registry.get_stage(name)` what a stage needs: its data
unit, sequences per row, whether it uses reference log-probs, its metric names, the data
formats it trains on, the dataclass of its config section (`dpo: {beta: 0.1}`), and how to
build its objective. This package imports nothing of keel
but `keel.losses` (inside the loss functions), so `keel.config` can read the stage names.
"""
