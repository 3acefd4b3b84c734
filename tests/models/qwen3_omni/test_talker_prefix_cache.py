"""Qwen3-Omni's talker on the prefix cache (talker.talker_prefix_key): a later spoken turn's
talker prompt begins with the earlier turns' user rows, so it is served from the cache for the
first turn's user rows (the hit count is exactly their full blocks), and its text, codes (every
codebook) and audio equal a run without the cache. A turn whose history differs only in an
earlier assistant reply (dropped from the talker's prompt, but seen by the thinker's hidden
rows at later placeholders) hits no further than the shared user rows."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import OmniLLM
from omnistage.engine.ar.sequence import MediaSpan
from omnistage.engine.ar.block_manager import block_hash
from omnistage.models.qwen3_omni.talker import (Qwen3OmniThinkerToTalker, talker_prefix_key,
                                                user_positions)
from tests.models.qwen3_omni.test_pipeline import _media, greedy


def _user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def _conversations(first_reply: str) -> tuple[list[dict], list[dict], list[dict]]:
    m = _media()
    turn1 = [_user({"type": "audio", "audio": m["tone"]},
                   {"type": "text", "text": "What is this? Tell me."})]
    tone_back = np.ascontiguousarray(m["tone"][::-1])  # (long enough for whole blocks)
    later = _user({"type": "audio", "audio": tone_back}, {"type": "text", "text": "And this?"})
    turn2 = turn1 + [{"role": "assistant", "content": first_reply}, later]
    other = turn1 + [{"role": "assistant", "content": "A different answer, longer."}, later]
    return turn1, turn2, other


def _run(model_dir, cache: bool, device: str = "cpu") -> dict:
    llm = OmniLLM(str(model_dir), device=device, dtype="float32", max_model_len=1024,
                  num_kv_blocks=256, enable_prefix_caching=cache)
    try:
        talker = llm.pipeline.engines["talker"]
        params = greedy()
        out: dict = {"bs": talker.config.block_size, "ids": llm.pipeline.token_ids}

        def turn(messages: list[dict]):
            before = talker.stats["prefix_cache_hit_tokens"]
            res = llm.generate({"messages": messages}, params, use_tqdm=False)[0]
            assert res.error is None, res.error
            return res, talker.stats["prefix_cache_hit_tokens"] - before

        first, out["hits1"] = turn(_conversations("")[0])
        _, turn2, other = _conversations(first.text)
        out["first"] = first
        out["second"], out["hits2"] = turn(turn2)
        out["other"], out["hits_other"] = turn(other)
        return out
    finally:
        llm.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_second_turn_hits_the_talker_cache_and_matches_no_cache(tiny_qwen3_omni_dir, device):
    """(On CUDA: the talker's prefill from a hit through the prefill and decode graphs.)"""
    on = _run(tiny_qwen3_omni_dir, True, device)
    off = _run(tiny_qwen3_omni_dir, False, device)
    bs, ids = on["bs"], on["ids"]
    prompt1 = on["first"].prompt_token_ids
    u1 = len(user_positions(prompt1, ids["im_start"], ids["user"]))
    u2 = len(user_positions(on["second"].prompt_token_ids, ids["im_start"], ids["user"]))
    assert u1 // bs >= 2 and u2 // bs > u1 // bs + 1, (u1, u2, bs)  # (room for a false hit)
    assert on["hits1"] == 0 and off["hits2"] == off["hits_other"] == 0
    # the first turn's user rows, in full blocks: the whole common talker prefix
    assert on["hits2"] == u1 // bs * bs
    # the thinker hit its first turn too (rows kept beside the blocks)
    assert on["second"].metrics.num_cached_tokens >= len(prompt1) // bs * bs
    # another earlier reply: the later user turn's ids and audio are the same, its rows not
    assert on["hits_other"] == u1 // bs * bs
    for key in ("first", "second", "other"):
        a, b = on[key], off[key]
        assert a.token_ids == b.token_ids, key
        assert a.stages["talker"].token_ids == b.stages["talker"].token_ids, key
        assert len(a.stages["talker"].codes) > 4, key
        assert np.array_equal(a.stages["talker"].codes, b.stages["talker"].codes), key
        assert a.audio.shape == b.audio.shape, key
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-4 if device == "cpu" else 2e-3)


def _key_hashes(prompt: list[int], media: list[MediaSpan], bs: int) -> list[bytes]:
    """The talker's block hashes as BlockManager chains them."""
    ids = {"im_start": 1, "user": 2, "assistant": 3, "tts_bos": 4, "tts_eos": 5, "tts_pad": 6}
    adapter = Qwen3OmniThinkerToTalker(prompt, [9], ids, [0] * 6)
    hash_ids, spans = talker_prefix_key(adapter, media)
    # from the assistant rows on (voice, reply): a span of this request alone
    private = [m for m in spans if m.start == len(hash_ids)]
    assert len(private) == 1 and private[0].end > 1 << 40
    assert private[0].content_hash not in {m.content_hash for m in
                                           talker_prefix_key(adapter, media)[1]}
    out, parent = [], b""
    for b in range(len(hash_ids) // bs):
        lo, hi = b * bs, (b + 1) * bs
        parent = block_hash(parent, hash_ids[lo:hi],
                            [(m.start - lo, m.content_hash) for m in spans
                             if m.start < hi and m.end > lo])
        out.append(parent)
    return out


@pytest.mark.parametrize("change", ["system", "assistant", "media", "none"])
def test_the_key_covers_what_sets_the_rows(change):
    """Thinker prompts: system, user (with a media span), assistant, user, assistant header.
    A change the talker does not see as a row (system, an assistant reply) or a media content
    changes every block from the first user row after it; none changes nothing."""
    sys_turn, asst = [1, 7, 20, 21, 22], [1, 3, 30, 31, 32, 33]
    user1 = [1, 2] + [40 + i for i in range(6)] + [9] * 8 + [50, 51]
    user2 = [1, 2] + [60 + i for i in range(14)]
    prompt = sys_turn + user1 + asst + user2 + [1, 3, 8]
    media = [MediaSpan(len(sys_turn) + 8, len(sys_turn) + 16, b"a" * 16)]
    base = _key_hashes(prompt, media, 4)
    if change == "system":
        prompt = [1, 7, 20, 29, 22] + prompt[5:]
    elif change == "assistant":
        at = len(sys_turn) + len(user1) + 3
        prompt = prompt[:at] + [99] + prompt[at + 1:]
    elif change == "media":
        media = [MediaSpan(media[0].start, media[0].end, b"b" * 16)]
    got = _key_hashes(prompt, media, 4)
    assert len(got) == len(base) == (len(user1) + len(user2)) // 4
    first_diff = next((i for i, (a, b) in enumerate(zip(got, base)) if a != b), None)
    expected = {"system": 0, "assistant": len(user1) // 4, "media": 2, "none": None}[change]
    assert first_diff == expected
