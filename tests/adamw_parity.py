"""Comparing a training run with ``torch.optim.AdamW``'s without comparing rounding noise.

AdamW moves a parameter by ``lr * m / (s + eps)`` (plus the decay ``lr * wd * p``), where
``m = exp_avg / (1 - beta1**t)`` is the bias-corrected mean of the gradients so far and
``s = sqrt(exp_avg_sq / (1 - beta2**t))`` their root mean square. Both have the scale of the
gradients and depend on them smoothly, so they are compared like any computed value (the
caller's ``rtol``/``atol``). The update is another matter: at the first step it is
``lr * g / (|g| + eps)``, whose derivative in ``g`` is ``lr * eps / (|g| + eps)**2``. For
``|g| >> eps`` that is tiny (a gradient off by ``d`` moves the update by ``lr * d * eps / g**2``),
but at ``|g| <= eps`` it reaches ``lr / eps`` (1e6 for ``lr = 1e-2, eps = 1e-8``): a gradient
that nearly cancels, whose last-bit rounding (~1e-11, another summation order when it is
sharded or run on another number of threads) is a large part of it, moves its parameter by
1e-5 in one step. A parameter compared at 1e-5 after AdamW then compares that rounding.

So :class:`AdamWParity` compares, after every step, each parameter's ``m`` and ``s`` at the
caller's tolerance (that is where a wrong gradient shows: every gradient enters ``m`` and ``s``
at its own scale), and the final parameters at the same tolerance **plus** the difference
that the two sides' moments, as compared, make in the updates: ``lr * |m_got / (s_got + eps) -
m_want / (s_want + eps)|`` per step, carried to later steps shrunk by ``1 - lr * wd`` as the
decay shrinks a difference of the parameters. Where the gradient is well above ``eps`` this
addition is below 1e-8, so the parameter comparison is the caller's; it only widens where the
update divides a gradient's rounding by ``eps``, and there the gradient itself was compared.
A wrong update (learning rate, decay, bias correction, a skipped step) is not explained by
the moments and still fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _moments(state: Mapping[str, Any], betas: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """``(m, s)``: AdamW's bias-corrected first moment and the square root of its second."""
    t = float(state["step"])
    m = state["exp_avg"] / (1 - betas[0] ** t)
    s = (state["exp_avg_sq"] / (1 - betas[1] ** t)).sqrt()
    return m, s


class AdamWParity:
    """Follows a run against ``want``, a ``torch.optim.AdamW`` over ``names`` (the names of its
    parameters, in its order): call :meth:`after_step` with the run's optimizer state after
    each step (``optimizer.state_dict()["state"]`` layout: parameter position -> ``step``,
    ``exp_avg``, ``exp_avg_sq``), then :meth:`check_parameters` with its final parameters."""

    def __init__(
        self, want: torch.optim.Optimizer, names: list[str], rtol: float, atol: float
    ) -> None:
        self.want, self.names, self.rtol, self.atol = want, names, rtol, atol
        self.slack: dict[int, torch.Tensor] = {}  # position -> the updates' difference so far
        self.steps: dict[int, float] = {}  # position -> its step count at the last check

    def after_step(self, got_state: Mapping[int, Mapping[str, Any]]) -> None:
        """Each parameter's ``m`` and ``s`` after this step (its gradients at their own scale),
        and the difference they make in this step's update, added to the parameter's slack."""
        sd = self.want.state_dict()
        want_state = sd["state"]
        groups = {i: group for group in sd["param_groups"] for i in group["params"]}
        assert sorted(got_state) == sorted(want_state), "the parameters stepped so far differ"
        for i, want in want_state.items():
            name, got, group = self.names[i], got_state[i], groups[i]
            assert float(got["step"]) == float(want["step"]), f"{name}: step count"
            if float(want["step"]) == self.steps.get(i):  # not stepped this time (no gradient)
                continue
            self.steps[i] = float(want["step"])
            (m_got, s_got), (m_want, s_want) = (_moments(x, group["betas"]) for x in (got, want))
            for what, a, b in (("mean gradient", m_got, m_want), ("RMS gradient", s_got, s_want)):
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=self.rtol,
                    atol=self.atol,
                    msg=lambda m, n=name, w=what, t=self.steps[i]: f"{n}'s {w}, step {t:g}: {m}",
                )
            eps, lr = group["eps"], group["lr"]
            update = (m_got / (s_got + eps) - m_want / (s_want + eps)).abs()
            before = self.slack.get(i, torch.zeros_like(update))
            self.slack[i] = before * (1 - lr * group["weight_decay"]) + lr * update

    def check_parameters(self, got: Mapping[str, torch.Tensor]) -> None:
        """The final parameters: ``|got - want| <= atol + rtol * |want| + slack`` per element."""
        params = [p for group in self.want.param_groups for p in group["params"]]
        for i, (name, p_want) in enumerate(zip(self.names, params, strict=True)):
            want = p_want.detach()
            slack = self.slack.get(i, torch.zeros_like(want))
            allowed = self.atol + self.rtol * want.abs() + slack
            excess = (got[name].detach() - want).abs() - allowed
            if excess.numel() and float(excess.max()) > 0:
                k = int(excess.argmax())
                raise AssertionError(
                    f"{name}: element {k} is {float(got[name].flatten()[k])}, torch.optim's "
                    f"{float(want.flatten()[k])}; allowed {float(allowed.flatten()[k]):.3g} "
                    f"({float(slack.flatten()[k]):.3g} of it from the moments' difference); "
                    f"{int((excess > 0).sum())} elements beyond"
                )
