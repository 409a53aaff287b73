"""Training data: sources, formats, chat templates, masking, packing, validation report.

`prepare_data` turns `data:` of the run config into rows of input_ids / targets
(pre-shifted: targets[i] is the token position i must predict, or -100) / position_ids,
plus labels (and KL sequences for KTO) in the preference stages; `epoch_order` and
`collate` turn those rows into batches.
"""

from keel.data.batching import collate, epoch_order
from keel.data.pipeline import PreparedData, prepare_data
from keel.data.report import DataReport, Rejection

__all__ = ["DataReport", "PreparedData", "Rejection", "collate", "epoch_order", "prepare_data"]
