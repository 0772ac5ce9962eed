#!/usr/bin/env bash
# Pretrain a ~1.5B GPT with two MTP draft heads trained by the TV loss, on one 8-GPU node, running
# upstream Megatron-LM's pretrain_gpt.py unchanged through the plugin launcher.
#
# Needs: a GPU node (8x H100/H200 as written: TP=2 with sequence parallel, DP=4), a Megatron-LM
# checkout of core_r0.19 (for pretrain_gpt.py; megatron-core 0.19.2 itself may come from pip or
# from that checkout), Transformer Engine (--transformer-impl transformer_engine), and this
# package installed (pip install -e <this repo>). Without DATA_PATH it trains on Megatron's mock
# data with a null tokenizer, which is enough to check the set-up and the MTP metrics.
#
#   MEGATRON_LM=~/src/Megatron-LM bash examples/pretrain_gpt_mtp_tv.sh
#   MEGATRON_LM=... DATA_PATH=/data/my_text_document TOKENIZER=/models/tok bash examples/pretrain_gpt_mtp_tv.sh
#   PRINT_ARGS=1 bash examples/pretrain_gpt_mtp_tv.sh   # print pretrain_gpt.py's arguments, NUL-separated
#
# The only TV-specific flags are in MTP_ARGS (--mtp-loss-type tv --mtp-tv-chunk 512); everything
# else is a usual Megatron launch. 'tv' trains the heads for acceptance itself. Pretraining from
# scratch is not among the measured scenarios (README, "Which loss when"). The nearest there, a
# trained head fine-tuned together with its backbone (the head's loss reaching the backbone, as
# here), did better with 'ce' than with any alternative for greedy drafts (at T=1: resolved
# against 'kl' only); fresh heads added to a trained model over a large vocabulary did better
# with 'kl' or 'lk' than with 'tv'. Checked by tests/test_examples.py, which parses these
# arguments with Megatron's own parse_args/validate_args with the plugin installed.
set -euo pipefail

NPROC=${NPROC:-8}
OUT=${OUT:-./out/pretrain_gpt_mtp_tv}

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 5632
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 4
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --transformer-impl transformer_engine
    --attention-backend auto
)

# Two MTP depths, trained for speculative-decoding acceptance: per-depth TV (use e2e_tv for the
# end-to-end objective over both depths). Chunks of 512 tokens bound the loss's extra memory to
# O(512 * vocab / TP) whatever the sequence length.
MTP_ARGS=(
    --mtp-num-layers 2
    --mtp-loss-scaling-factor 0.1
    --mtp-loss-type tv
    --mtp-tv-chunk 512
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 1
    --context-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --train-iters 20000
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 500
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --init-method-std 0.02
    --bf16
)

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "${TOKENIZER:?set TOKENIZER to the tokenizer of DATA_PATH}"
        --split 990,8,2
    )
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 131072)
fi

LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 1000
    --eval-iters 10
    --save-interval 2000
    --save "$OUT/checkpoints"
    --tensorboard-dir "$OUT/tensorboard"
    --log-throughput
)

ARGS=("${MODEL_ARGS[@]}" "${MTP_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
      "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}")

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '%s\0' "${ARGS[@]}"
    exit 0
fi

MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (it has pretrain_gpt.py)}
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The launcher installs the plugin, then runs pretrain_gpt.py as __main__ with these arguments.
exec torchrun --nproc-per-node "$NPROC" -m megatron.mtp_tv.launch \
    "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}"
