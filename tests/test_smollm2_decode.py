"""The KV-cached incremental decode of the SmolLM2 demo equals the model's full forward.

Reference: ``GPTModel``'s own modules run over the whole sequence at once (the decoder and each
MTP depth through ``cpu_demo_lib.model.hidden_states``, itself checked against
``GPTModel.forward`` in ``test_cpu_demo.py``). The decode runs a ragged batch the way speculative
decoding does: each row advances by its own number of tokens per call, and tokens a row wrote and
then "rejected" are overwritten by the next call, so a cache that read a stale key or value, a
rope applied at the wrong position or a mixed-up query-group layout would show.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'examples'))

SEQ, BATCH, DEPTHS = 20, 3, 2


def _llama_like_model(vocab_size: int = 97):
    """A small rope model with SmolLM2's layer shape: RMSNorm, SwiGLU, grouped queries, no bias."""
    from mtp_tv_dev.models import build_gpt_with_mtp

    return build_gpt_with_mtp(
        vocab_size=vocab_size, hidden_size=48, num_layers=2, mtp_num_layers=DEPTHS, seq_length=SEQ,
        num_attention_heads=6, seed=11, position_embedding_type='rope', rotary_base=1000,
        normalization='RMSNorm', gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        num_query_groups=2, add_bias_linear=False, bias_activation_fusion=False,
        ffn_hidden_size=80, rotary_interleaved=False, apply_rope_fusion=False,
    ).eval()


def _ragged_decode(extend, valid: int, generator):
    """Drive ``extend(positions, pick) -> [m, B, h]`` like speculative decoding: each call feeds
    every row ``m`` positions from its own length on, true inputs for the first ``a_b`` of them and
    garbage after (``a_b`` random; ``pick(truth, garbage)`` chooses); a row keeps the outputs of
    its ``a_b`` true positions and advances by ``a_b``. Returns ``[valid, B, h]`` the kept
    outputs."""
    from smollm2_lib.decode import arange_positions

    lengths = torch.zeros(BATCH, dtype=torch.long)
    kept = {}
    while int(lengths.min()) < valid:
        m = int(torch.randint(1, 5, (1,), generator=generator))
        positions = arange_positions(lengths, m)
        accept = torch.randint(1, m + 1, (BATCH,), generator=generator)
        true = torch.arange(m) < accept.unsqueeze(1)  # [B, m]

        def pick(truth, garbage):  # tokens [B, m] or states [m, B, h]
            return torch.where(true if truth.dim() == 2 else true.T.unsqueeze(-1), truth, garbage)

        out = extend(positions, pick)
        for b in range(BATCH):
            for i in range(int(accept[b])):
                kept[(int(positions[b, i]), b)] = out[i, b]
        lengths += accept
    return torch.stack([torch.stack([kept[(t, b)] for b in range(BATCH)]) for t in range(valid)])


def _inputs_at(store, positions, length):
    """``store`` ``[B, L]`` tokens or ``[L, B, h]`` states at clamped positions (beyond the
    sequence: the last valid entry, only ever garbage)."""
    from smollm2_lib.decode import gather_steps

    clamped = positions.clamp(max=length - 1)
    if store.dim() == 2:
        return store.gather(1, clamped)
    return gather_steps(store, clamped)


def test_ragged_kv_decode_equals_full_forward(megatron_cpu):
    from cpu_demo_lib import model as M
    from smollm2_lib.decode import DecoderCache, MTPDepthCache

    model = _llama_like_model()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (BATCH, SEQ), generator=generator)
    reference = M.hidden_states(model, tokens, DEPTHS)  # [main, depth 0, depth 1], [s, B, h]
    garbage_tokens = torch.randint(0, 97, (BATCH, SEQ + 8), generator=generator)
    capacity = SEQ + 8

    cache = DecoderCache(model, BATCH, capacity)

    def main_extend(positions, pick):
        ids = pick(_inputs_at(tokens, positions, SEQ), garbage_tokens.gather(1, positions))
        return cache.extend(ids, positions)

    main = _ragged_decode(main_extend, SEQ, generator)
    torch.testing.assert_close(main, reference[0], rtol=1e-5, atol=2e-5)

    for depth in range(DEPTHS):
        # depth k at position t reads depth k-1's (the main decoder's) output at t and token t+k+1;
        # Megatron's rolled tokens end in zeros, so only t <= SEQ - depth - 2 are compared.
        valid = SEQ - depth - 1
        depth_cache = MTPDepthCache(model, depth, BATCH, capacity)
        previous = reference[depth]
        shifted = torch.cat([tokens[:, depth + 1:],
                             tokens.new_zeros(BATCH, depth + 1)], dim=1)  # token t+k+1 at t
        noise = torch.randn(capacity, BATCH, previous.shape[-1], generator=generator)

        def depth_extend(positions, pick):
            prev = pick(_inputs_at(previous, positions, SEQ), noise[positions.T, torch.arange(BATCH)])
            ids = pick(_inputs_at(shifted, positions, SEQ), garbage_tokens.gather(1, positions))
            return depth_cache.extend(prev, ids, positions)

        out = _ragged_decode(depth_extend, valid, generator)
        torch.testing.assert_close(out, reference[depth + 1][:valid], rtol=1e-5, atol=2e-5)


def test_decode_refuses_positions_beyond_capacity(megatron_cpu):
    from smollm2_lib.decode import DecoderCache

    model = _llama_like_model()
    cache = DecoderCache(model, 1, 4)
    with pytest.raises(ValueError, match='beyond the cache capacity 4'):
        cache.extend(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[3, 4]]))


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_speculative_decoding_equals_the_full_forward(megatron_cpu, temperature):
    """Speculative decoding through the caches, against the full forward of the committed text:

    * each verify step drafts what the heads' full forward gives: a step that starts from emitted
      token ``L`` drafts depth ``k`` from position ``L - 1``, which reads tokens up to ``L + k``:
      committed text wherever drafts ``1 .. k`` were accepted, so there its logits equal the full
      forward's. A stale MTP-cache entry (written with a rejected draft), a draft read before it
      was drawn or a token committed at the wrong position would change them;
    * greedy: the committed text is the main model's own greedy decoding (greedy verification
      keeps it whatever the heads draft), and each step accepts the longest prefix of the full
      forward's argmax drafts that the text continues with.

    Vocabulary 3, so random heads are accepted often and rows advance by different amounts.
    """
    from cpu_demo_lib import model as M
    from smollm2_lib import evaluate as E

    model = _llama_like_model(vocab_size=3)
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 3, (8, 6), generator=generator)
    rounds = 8
    state = E.Prompts.prefill(model, prompts, capacity=6 + rounds * (DEPTHS + 1) + 2 * DEPTHS + 2)
    out = E.speculative_decoding(model, state, DEPTHS, rounds, temperature, seed=0, trace=True)
    counts = out['accepted_per_step']
    assert out['verify_steps'] == counts.numel() == prompts.shape[0] * rounds
    assert 0 < counts.double().mean() < DEPTHS and len(set(out['lengths'].tolist())) > 1
    if temperature == 0:
        greedy = E.generate(model, prompts, int(out['lengths'].max()) - 6, 0.0, seed=0)
    checked = 0
    for b in range(prompts.shape[0]):
        text = out['tokens'][b, : int(out['lengths'][b])]
        states = M.hidden_states(model, text.unsqueeze(0), DEPTHS)
        full = torch.stack([M.project(model, s)[:, 0] for s in states[1:]])  # [D, s, V]
        if temperature == 0:
            assert torch.equal(text, greedy[b, : text.numel()])
        last = 6
        for step in range(rounds):
            accepted = int(counts[b, step])
            if temperature == 0:
                expected = 0
                while (expected < DEPTHS
                       and full[expected, last - 1].argmax() == text[last + 1 + expected]):
                    expected += 1
                assert accepted == expected, (b, step)
            for k in range(min(accepted + 1, DEPTHS)):  # drafts that read committed text only
                torch.testing.assert_close(out['draft_logits'][b, step, k], full[k, last - 1],
                                           rtol=1e-5, atol=1e-5)
                checked += k > 0
            last += accepted + 1
    assert checked > 0  # deeper drafts were compared, not only depth 0
