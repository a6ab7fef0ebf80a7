"""The expected status of every op-db entry that does not PASS under ``partita.jit``.

``tests/test_opdb.py`` checks this table against ``tests/opdb_sweep.py``: an entry that is not
PASS must be listed here with the same status, and an entry listed here must not PASS (so the
table stays true). ``WRONG`` is never an expected status. Regenerate the entries you ran with
``.venv/bin/python tests/opdb_sweep.py --ops a,b --write-status`` (or ``--all``), then read
the diff: the second field is the reason (the aten op for UNSUPPORTED, the error's first line,
or why the entry is skipped).
"""

from __future__ import annotations

STATUS: dict[str, tuple[str, str]] = {
    "allclose": ("SKIP", "results that are not all tensors"),
    "argwhere": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (aten.nonzero.default, shap",
    ),
    "bernoulli": ("SKIP", "random"),
    "bincount": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (aten.bincount.default, sha",
    ),
    "broadcast_shapes": ("SKIP", "results that are not all tensors"),
    "cauchy": ("SKIP", "random"),
    "combinations": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (aten.masked_select.default",
    ),
    "corrcoef": (
        "CAPTURE",
        "DataDependentOutputException: aten.equal.default. This is data-dependent: the li",
    ),
    "cov": (
        "CAPTURE",
        "DataDependentOutputException: aten.equal.default. This is data-dependent: the li",
    ),
    "empty": ("SKIP", "uninitialised values (empty*)"),
    "empty_like": ("SKIP", "uninitialised values (empty*)"),
    "empty_permuted": ("SKIP", "uninitialised values (empty*)"),
    "empty_strided": ("SKIP", "uninitialised values (empty*)"),
    "equal": ("SKIP", "results that are not all tensors"),
    "exponential": ("SKIP", "random"),
    "geometric": ("SKIP", "random"),
    "istft": (
        "CAPTURE",
        "DataDependentOutputException: aten.equal.default. This is data-dependent: the li",
    ),
    "item": ("SKIP", "results that are not all tensors"),
    "jiterator_2inputs_2outputs": (
        "SKIP",
        "eager raises AssertionError: Jiterator is only supported on CUDA and ROCm GPUs, ",
    ),
    "jiterator_4inputs_with_extra_args": (
        "SKIP",
        "eager raises AssertionError: Jiterator is only supported on CUDA and ROCm GPUs, ",
    ),
    "jiterator_binary": (
        "SKIP",
        "eager raises AssertionError: Jiterator is only supported on CUDA and ROCm GPUs, ",
    ),
    "jiterator_binary_return_by_ref": (
        "SKIP",
        "eager raises AssertionError: Jiterator is only supported on CUDA and ROCm GPUs, ",
    ),
    "jiterator_unary": (
        "SKIP",
        "eager raises AssertionError: Jiterator is only supported on CUDA and ROCm GPUs, ",
    ),
    "linalg.lstsq": (
        "CAPTURE",
        "DynamicOutputShapeException: aten.linalg_lstsq.default. This is data-dependent: ",
    ),
    "linalg.lstsq.grad_oriented": (
        "CAPTURE",
        "DynamicOutputShapeException: aten.linalg_lstsq.default. This is data-dependent: ",
    ),
    "log_normal": ("SKIP", "random"),
    "masked.normalize": ("SKIP", "random"),
    "masked_select": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (aten.masked_select.default",
    ),
    "multinomial": ("SKIP", "random"),
    "narrow": (
        "CAPTURE",
        "it computes a Python number read from a tensor (aten._local_scalar_dense.default",
    ),
    "native_dropout_backward": ("SKIP", "random"),
    "new_empty": ("SKIP", "uninitialised values (empty*)"),
    "new_empty_strided": ("SKIP", "uninitialised values (empty*)"),
    "nn.functional.alpha_dropout": ("SKIP", "random"),
    "nn.functional.batch_norm.without_cudnn": ("SKIP", "no float32, int64 or complex64 on CPU"),
    "nn.functional.ctc_loss": (
        "CAPTURE",
        "DynamicOutputShapeException: aten._ctc_loss.default. This is data-dependent: the",
    ),
    "nn.functional.dropout": ("SKIP", "random"),
    "nn.functional.dropout2d": ("SKIP", "random"),
    "nn.functional.dropout3d": ("SKIP", "random"),
    "nn.functional.feature_alpha_dropout.with_train": ("SKIP", "random"),
    "nn.functional.feature_alpha_dropout.without_train": ("SKIP", "random"),
    "nn.functional.fractional_max_pool2d": ("SKIP", "random"),
    "nn.functional.fractional_max_pool3d": ("SKIP", "random"),
    "nn.functional.gaussian_nll_loss": (
        "CAPTURE",
        "GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0,",
    ),
    "nn.functional.normalize": ("SKIP", "random"),
    "nn.functional.one_hot": (
        "CAPTURE",
        "GuardOnDataDependentSymNode: Could not extract specialized integer from data-dep",
    ),
    "nn.functional.poisson_nll_loss": ("SKIP", "random"),
    "nonzero": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (aten.nonzero.default, shap",
    ),
    "normal": ("SKIP", "random"),
    "normal.in_place": ("SKIP", "random"),
    "normal.number_mean": ("SKIP", "random"),
    "rand_like": ("SKIP", "random"),
    "randint": ("SKIP", "random"),
    "randint_like": ("SKIP", "random"),
    "randn": ("SKIP", "random"),
    "randn_like": ("SKIP", "random"),
    "signal.windows.exponential": ("SKIP", "random"),
    "sparse.mm.reduce": ("SKIP", "sparse or other non-strided layout"),
    "sparse.sampled_addmm": ("SKIP", "sparse or other non-strided layout"),
    "tensor_split": (
        "CAPTURE",
        "RuntimeError: The tensor has a non-zero number of elements, but its data is not ",
    ),
    "to_sparse": ("SKIP", "sparse or other non-strided layout"),
    "torch._scaled_mm": ("SKIP", "no float32, int64 or complex64 on CPU"),
    "torch._scaled_mm_v2": ("SKIP", "no float32, int64 or complex64 on CPU"),
    "torch.ops.aten._efficient_attention_forward": (
        "SKIP",
        "no float32, int64 or complex64 on CPU",
    ),
    "torch.ops.aten._flash_attention_forward": ("SKIP", "no float32, int64 or complex64 on CPU"),
    "uniform": ("SKIP", "random"),
    "unique": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (<built-in function getitem",
    ),
    "unique_consecutive": (
        "CAPTURE",
        "it computes a tensor whose shape depends on the data (<built-in function getitem",
    ),
}
