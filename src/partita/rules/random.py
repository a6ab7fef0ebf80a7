"""Rules of random ops: ``bernoulli``, ``native_dropout``, ``rand``/``randn`` and their
``*_like`` forms, ``uniform``/``normal``, and the distributions that fill a tensor's shape
(``cauchy``, ``exponential``, ``geometric``, ``log_normal``, and ``random``, the functional
``random_``: ``randint`` on a device other than the CPU); the draws whose tensors are the
distribution's parameters (``normal(mean, std)``, ``poisson``, ``binomial``, ``multinomial``).

Random-number policy (see docs/rules.md): partita draws every random tensor with its *global*
shape from the global generator state and each device keeps its own tile, so a sharded
program's dropout masks equal the unsharded program's for the same seed, whatever the mesh.
Every rule here says so with ``handler="global_random"``: the partitioner must not run the op
on local shapes (that would draw different numbers); it materialises the global random tensor
(or an equivalent counter-based draw indexed by global position) and slices the tile. The
factors are those of an elementwise op (or result-only, for ``rand(size)``).
"""

from __future__ import annotations

from partita.rules.common import Names, aten_ops, build
from partita.rules.elementwise import elementwise_rule
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("random")

__all__ = [
    "GENERATOR_OVERLOADS",
    "RANDOM_LIKE_OPS",
    "RANDOM_VALUE_OPS",
    "multinomial_rule",
    "random_create_rule",
    "random_like_rule",
    "random_value_rule",
]

RANDOM_LIKE_OPS = aten_ops(
    [
        "bernoulli.default",
        "bernoulli.p",
        "bernoulli_.float",
        "cauchy.default",
        "exponential.default",
        "geometric.default",
        "log_normal.default",
        "native_dropout.default",
        "normal_.default",
        "normal_functional.default",
        "rand_like.default",
        "randint_like.default",
        "randn_like.default",
        "random.default",
        "random.from",
        "random.to",
        "uniform.default",
        "uniform_.default",
    ]
)


#: They read only their operand's shape and dtype.
RULES.declare(aten_ops(["rand_like.default", "randn_like.default"]), OpFacts(shape_only=True))


@RULES.register(*RANDOM_LIKE_OPS)
def random_like_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b, a b; handler=global_random`` for ``native_dropout`` (output, mask)."""
    return elementwise_rule(info, handler=HandlerName.GLOBAL_RANDOM)


#: Draws whose tensor operands are parameters of the distribution (a mean, a rate, a count,
#: probabilities), not only a shape: the draw reads their whole global values.
RANDOM_VALUE_OPS = aten_ops(
    [
        "bernoulli.default",
        "binomial.default",
        "multinomial.default",
        "normal.Tensor_Tensor",
        "normal.Tensor_float",
        "normal.float_Tensor",
        "poisson.default",
        "rrelu_with_noise_functional.default",
    ]
)


@RULES.register(
    *aten_ops(
        [
            "binomial.default",
            "normal.Tensor_Tensor",
            "normal.Tensor_float",
            "normal.float_Tensor",
            "poisson.default",
            "rrelu_with_noise_functional.default",
        ]
    )
)
def random_value_rule(info: OpInfo) -> FactorRule:
    """``a b, a b -> a b; handler=global_random`` for ``torch.normal(mean, std)``: one draw
    per element of the broadcast parameters (``torch.poisson(rates)``, ``binomial(count,
    prob)``, ``F.rrelu`` in training: a slope drawn for each negative element of ``x``)."""
    return elementwise_rule(info, handler=HandlerName.GLOBAL_RANDOM)


@RULES.register(*aten_ops(["multinomial.default"]))
def multinomial_rule(info: OpInfo) -> FactorRule:
    """``b c -> b n; need_replication=c; handler=global_random`` for ``torch.multinomial(probs,
    n)``: each row of ``n`` samples reads its whole row of probabilities (``c -> n`` for one
    row)."""
    (probs,) = info.operands
    names = Names()
    c, n = names.new(), names.new()
    batch = names.take(probs.ndim - 1)
    return build(
        info, [[*batch, c]], [[*batch, n]], need_replication=c, handler=HandlerName.GLOBAL_RANDOM
    )


#: The ``generator=`` overloads of the creating draws, each with its generator-free overload:
#: ``torch.randn(shape, generator=None)`` (diffusers' ``randn_tensor``) selects
#: ``randn.generator``. The partitioner draws with the generator-free overload (the global
#: generator, as ``generator=None`` means); a ``torch.Generator`` object is refused there.
GENERATOR_OVERLOADS: dict[str, str] = {
    "normal.float_float": "normal.float_float",
    "rand.generator": "rand.default",
    "randint.generator": "randint.default",
    "randint.low_generator": "randint.low",
    "randn.generator": "randn.default",
    "randperm.generator": "randperm.default",
}


@RULES.register(
    *aten_ops(
        sorted(
            [
                "rand.default",
                "randint.default",
                "randint.low",
                "randn.default",
                "randperm.default",
                *GENERATOR_OVERLOADS,
            ]
        )
    )
)
def random_create_rule(info: OpInfo) -> FactorRule:
    """``-> a b; handler=global_random`` for ``rand(4, 8)``."""
    out = info.result()
    return build(
        info,
        [None] * len(info.operands),
        [Names().take(out.ndim)],
        handler=HandlerName.GLOBAL_RANDOM,
    )
