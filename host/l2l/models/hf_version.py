"""Which transformers is installed, against the range l2l declares and was tested at.

The floor is read from l2l's own package metadata (``pyproject.toml``'s ``hf`` extra), so
the number lives in one place; ``make test-oldest`` runs the tests at it. An older
transformers is refused in one line rather than failing later with a traceback.
"""
from __future__ import annotations

from ..errors import UserError

DTYPE_KEYWORD_SINCE = "4.56"  # from_config/from_pretrained took ``torch_dtype=`` before
FUSED_EXPERTS_SINCE = "5.0"  # MoE routers as modules whose logits transformers records, experts fused


def need_transformers() -> None:
    """Refuse, in one line, a missing transformers or one outside the declared range."""
    try:
        import transformers
    except ImportError:
        raise UserError("the hf-* models and model directories need Hugging Face transformers: "
                        "pip install 'l2l[hf]'") from None
    wanted = declared_range()
    if wanted is None:
        return
    from packaging.version import Version
    if not wanted.contains(Version(transformers.__version__), prereleases=True):
        raise UserError(f"l2l needs transformers{wanted}, this environment has {transformers.__version__}: "
                        f"pip install 'transformers{wanted}'")


def declared_range():
    """The ``transformers`` specifier of l2l's ``hf`` extra (a ``SpecifierSet``), or None when
    l2l runs from a source tree with no installed metadata."""
    from importlib.metadata import PackageNotFoundError, requires
    from packaging.requirements import Requirement
    try:
        requirements = requires("l2l") or []
    except PackageNotFoundError:
        return None
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "transformers" and requirement.marker and requirement.marker.evaluate({"extra": "hf"}):
            return requirement.specifier
    return None


def dtype_kwarg(dtype) -> dict:
    """``from_config``'s keyword for the parameters' dtype in the installed transformers: ``dtype``
    from 4.56 on (``torch_dtype`` still works there, with a deprecation warning), ``torch_dtype``
    before."""
    import transformers
    from packaging.version import Version
    new = Version(transformers.__version__) >= Version(DTYPE_KEYWORD_SINCE)
    return {"dtype" if new else "torch_dtype": dtype}


def need_fused_experts(model_type: str) -> None:
    """Refuse, in one line, a mixture-of-experts checkpoint under a transformers older than 5:
    l2l reads router logits and expert weights as transformers 5 lays them out (and was tested
    there only), not 4.x's per-expert modules and router logits returned by each layer."""
    need_transformers()
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) < Version(FUSED_EXPERTS_SINCE):
        raise UserError(f"{model_type} (mixture of experts) needs transformers>={FUSED_EXPERTS_SINCE}, this "
                        f"environment has {transformers.__version__}: pip install 'transformers>={FUSED_EXPERTS_SINCE}'")
