"""The engine's denoising stage (engine/gen/diffusion.py) on a fake network: step-level
batching of requests at different steps with CFG rows, and the first-block step cache."""

from __future__ import annotations

import torch

from omnistage.engine.gen.diffusion import DenoiseRequest, Denoiser


class FakeNetwork:
    """first: state = (latents, t), probe = a function of t alone; rest: 2x + 1 of the latents
    of the asked rows (spied); finish: 0.1 x latents + residual; guide: plain CFG."""

    def __init__(self) -> None:
        self.dit = torch.nn.Linear(1, 1)
        self.rest_rows: list[list[int] | None] = []

    def predict(self, latents, timesteps, text, text_mask, grid):
        state, _ = self.first(latents, timesteps, text, text_mask, grid)
        return self.finish(state, (2 * latents + 1) + text.sum(dim=(1, 2))[:, None, None])

    def first(self, latents, timesteps, text, text_mask, grid):
        probe = torch.ones_like(latents) * (timesteps / 1000)[:, None, None]
        return (latents, text), probe

    def rest(self, state, rows):
        latents, text = state
        self.rest_rows.append(None if rows is None else rows.tolist())
        out = (2 * latents + 1) + text.sum(dim=(1, 2))[:, None, None]
        return out if rows is None else out[rows]

    def finish(self, state, residual):
        return 0.1 * state[0] + residual

    def guide(self, cond, uncond, scale, options):
        return uncond + scale * (cond - uncond)


def request(seed: int, steps: int, cfg: float, n: int = 1) -> DenoiseRequest:
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1, 0, steps + 1).tolist()
    return DenoiseRequest(torch.randn(n, 4, 3, generator=g), sigmas,
                          [1000 * s for s in sigmas[:-1]], [cfg] * steps, grid=(2, 2))


def run_all(denoiser: Denoiser, reqs: list[DenoiseRequest], join_at: list[int]):
    """Step the requests together, request i joining at step join_at[i]; final latents."""
    states = [denoiser.new_state(r) for r in reqs]
    for i, s in enumerate(states):
        g = torch.Generator().manual_seed(100 + i)
        denoiser.add_input(s, {"text": torch.randn(2 + i, 5, generator=g),
                               "negative": torch.randn(3, 5, generator=g)}, True)
    step = 0
    while any(not denoiser.done(s) for s in states):
        batch = [s for s, j in zip(states, join_at) if j <= step and not denoiser.done(s)]
        denoiser.run(batch)
        step += 1
    return [s.latents for s in states], states


def test_requests_at_different_steps_equal_each_alone():
    reqs = [request(0, 5, 0.0), request(1, 4, 3.0, n=2), request(2, 6, 2.0)]
    together, _ = run_all(Denoiser(FakeNetwork(), torch.device("cpu"), torch.float32), reqs,
                          [0, 1, 3])
    for i, r in enumerate(reqs):  # alone, with the text it had in the batch
        net = FakeNetwork()
        d = Denoiser(net, torch.device("cpu"), torch.float32)
        s = d.new_state(r)
        g = torch.Generator().manual_seed(100 + i)
        d.add_input(s, {"text": torch.randn(2 + i, 5, generator=g),
                        "negative": torch.randn(3, 5, generator=g)}, True)
        while not d.done(s):
            d.run([s])
        torch.testing.assert_close(together[i], s.latents)


def test_tiny_threshold_equals_no_cache():
    reqs = [request(0, 5, 0.0), request(1, 4, 3.0, n=2)]
    plain, _ = run_all(Denoiser(FakeNetwork(), torch.device("cpu"), torch.float32), reqs, [0, 1])
    net = FakeNetwork()
    cached, states = run_all(Denoiser(net, torch.device("cpu"), torch.float32, step_cache=1e-9),
                             reqs, [0, 1])
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a, b)
    assert all(s.cached_steps == 0 for s in states)
    assert all(rows is None for rows in net.rest_rows)  # every row computed every step


def test_cache_reuses_the_residual_of_the_last_computed_step():
    """A request whose probe did not move reuses its stored residual (its rows are not passed
    to rest); the other request's rows are computed."""
    net = FakeNetwork()
    d = Denoiser(net, torch.device("cpu"), torch.float32, step_cache=0.5)
    a, b = d.new_state(request(0, 4, 3.0, n=2)), d.new_state(request(1, 4, 0.0))
    for s in (a, b):
        d.add_input(s, {"text": torch.ones(2, 5), "negative": torch.zeros(3, 5)}, True)
    d.run([a, b])  # step 0: nothing stored yet, all rows computed
    assert net.rest_rows[-1] is None and a.residual.shape == (4, 4, 3)
    stored = a.residual.clone()
    b.probe = None  # b computes again; a's probe moves by |t1 - t0| / t0 = 0.25 < 0.5: reused
    d.run([a, b])
    assert a.cached_steps == 1 and b.cached_steps == 0
    # rows: a's cond rows 0-1, b's cond row 2, a's uncond rows 3-4: only b's row ran
    assert net.rest_rows[-1] == [2]
    torch.testing.assert_close(a.residual, stored)
    assert d.stats()["step_cache_reused_rows"] == 4
