#!/usr/bin/env bash
# Train the MTP head of Qwen3.5-35B-A3B with the TV loss in miles (GRPO RL with EAGLE speculative
# rollout), using miles' own recipe scripts/run_qwen3_5_35b_a3b_mtp.py and a patched Megatron-LM.
#
# Needs: a node with 8 GPUs (the recipe's H200/B300 set-up: ray, sglang, the model and data it
# downloads), a radixark/miles checkout (MILES), and a radixark/Megatron-LM checkout (MEGATRON_PATH,
# the one miles puts on PYTHONPATH) at one of the commits in patches/:
#   miles-main @ 36ceb4fc0, miles-main @ 2e64d788b, miles-main-20260819 @ 235952df6.
# miles runs Megatron from that checkout, so the feature goes in as a patch (the plugin cannot
# reach miles-main's MTP loss, which is inline in GPTModel._postprocess). miles passes unknown
# Megatron flags through (parse_args(extra_args_provider=...)), so the TV flags ride in the
# recipe's --extra-args; nothing in miles changes.
#
# Why 'tv': the model ships with a trained MTP head and RL moves the backbone under it. In the
# README's measurements ("Which loss when") such a head healed on the moved backbone did better
# with 'tv' than with 'ce', on SmolLM2-135M and on the CPU toy; on SmolLM2 'kl', 'lk' and 'nla'
# healed as well at T=1 and 'kl' better for greedy drafts (for greedy serving, put
# --mtp-loss-type kl in MTP_TV_ARGS below). But a head trained together with a backbone that its
# loss also trains did better with 'ce' for greedy drafts (at T=1: resolved against 'kl' only).
# miles trains the head during RL, its loss reaching the backbone's hidden states (the fork
# detaches the MTP branch's embedding and output layer): between the two and not measured, nor
# is RL as the drift (SFT on another domain was). Compare rollout/spec_accept_length against a
# 'ce' run.
#
# Parallel layouts: both of the recipe's, tp2-cp2-ep8 (the default: TP=2 with sequence parallel,
# CP=2, EP=8) and tp1-ep8. The loss is vocab-parallel over TP (with or without sequence
# parallel), exchanges zigzag halos over CP, follows packed (THD) sequences as miles feeds them,
# and runs on the last pipeline stage like Megatron's; EP does not touch the MTP loss. miles'
# --megatron-to-hf-mode bridge works too (the provider's finalize() takes the MTP loss flags the
# arguments ask for, and building the model raises where the two still differ), as do, on
# miles-main-20260819, packed sequences with the contiguous CP partition (docs/miles.md).
#
#   MILES=~/miles MEGATRON_PATH=~/Megatron-LM bash examples/miles_qwen3_5_35b_a3b_mtp_tv.sh
#   ... bash examples/miles_qwen3_5_35b_a3b_mtp_tv.sh --mode debug_minimal   # recipe options pass through
#   PRINT_ARGS=1 bash examples/miles_qwen3_5_35b_a3b_mtp_tv.sh  # the Megatron MTP/layout flags, NUL-separated
#
# Checked by tests/test_examples.py: PRINT_ARGS' flags parse through Megatron's parse_args with a
# miles-style extra_args_provider and reach TransformerConfig, with the plugin and on the
# patched 0.19.2 tree.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PARALLELISM=${PARALLELISM:-tp2-cp2-ep8}

# What this example adds to the recipe: the TV objective for the MTP head, in 512-token chunks.
MTP_TV_ARGS=(--mtp-loss-type tv --mtp-tv-chunk 512)

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    # The recipe's own MTP flags, the layout's Megatron flags, then ours (what Megatron sees).
    RECIPE_MTP=(--enable-mtp-training --mtp-num-layers 1 --mtp-loss-scaling-factor 0.2)
    case "$PARALLELISM" in
        tp2-cp2-ep8) LAYOUT=(--tensor-model-parallel-size 2 --sequence-parallel
                             --context-parallel-size 2 --expert-model-parallel-size 8) ;;
        tp1-ep8) LAYOUT=(--tensor-model-parallel-size 1 --sequence-parallel
                         --context-parallel-size 1 --expert-model-parallel-size 8) ;;
        *) echo "PARALLELISM must be tp2-cp2-ep8 or tp1-ep8" >&2; exit 2 ;;
    esac
    printf '%s\0' "${RECIPE_MTP[@]}" "${LAYOUT[@]}" "${MTP_TV_ARGS[@]}"
    exit 0
fi

MILES=${MILES:?set MILES to a radixark/miles checkout}
MEGATRON_PATH=${MEGATRON_PATH:-/root/Megatron-LM}

# 1. Patch the Megatron-LM checkout (idempotent): the patch made for its commit.
cd "$MEGATRON_PATH"
applied=
for patch in "$REPO"/patches/miles-main*.patch; do
    if git apply --reverse --check "$patch" 2>/dev/null; then
        applied=$patch; echo "already patched with $(basename "$patch")"; break
    fi
done
if [[ -z "$applied" ]]; then
    for patch in "$REPO"/patches/miles-main*.patch; do
        if git apply --check "$patch" 2>/dev/null; then
            git apply "$patch"; applied=$patch; echo "applied $(basename "$patch")"; break
        fi
    done
fi
if [[ -z "$applied" ]]; then
    echo "no patch in $REPO/patches applies to $MEGATRON_PATH at $(git rev-parse --short HEAD);" \
         "see docs/patches.md (tools/make_patches.py --tree writes one for your checkout)" >&2
    exit 1
fi

# 2. miles' recipe, unchanged, with the TV flags as extra Megatron arguments.
cd "$MILES"
exec python scripts/run_qwen3_5_35b_a3b_mtp.py \
    --megatron-path "$MEGATRON_PATH" \
    --parallelism "$PARALLELISM" \
    --extra-args "${MTP_TV_ARGS[*]}" \
    "$@"
