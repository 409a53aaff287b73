#!/bin/bash
# Two nodes x 8 GPUs without a scheduler. Run the same script on both nodes:
#   node0$ bash examples/torchrun_two_nodes.sh 0 node0
#   node1$ bash examples/torchrun_two_nodes.sh 1 node0
# Arguments: NODE_RANK (0 or 1) and HEAD (node 0's address, reachable from node 1).
# The repository, output.dir and the model/data cache must be on a filesystem both nodes
# see, or be identical copies: every worker reads the same config and data.
set -euo pipefail

NODE_RANK=${1:?usage: $0 NODE_RANK HEAD}
HEAD=${2:?usage: $0 NODE_RANK HEAD}
PORT=29500
LAUNCH=${LAUNCH:-keel}  # LAUNCH=torchrun runs the second form below

if [[ "$LAUNCH" == keel ]]; then
    # keel checks the config once, then runs torchrun for you (with the same flags as below).
    keel train examples/identity_lora.yaml --nproc 8 --nnodes 2 --node-rank "$NODE_RANK" \
        --rdzv-endpoint "$HEAD:$PORT" output.dir=outputs/identity-lora-2nodes
else
    # The same run with plain torchrun: it starts `python -m keel train ...` per GPU and
    # the workers detect torchrun from RANK/WORLD_SIZE. c10d assigns the node ranks itself.
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-id keel \
        --rdzv-endpoint "$HEAD:$PORT" \
        -m keel train examples/identity_lora.yaml output.dir=outputs/identity-lora-2nodes
fi
