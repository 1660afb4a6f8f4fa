"""The decay half of every optimizer step (SPEC 1.5), shared by the whole family: a group's options,
validated, and its decay computed but not written.

Per parameter group: matrices (``ndim >= 2``; a parameter of more dimensions holds the matrices its
group's ``matrix_view`` says, SPEC 1.8: a stack of them, ``"batch"``, or one, ``"flatten"``) get
``lambda_p * S_p(W)`` plus the ordinary ``lambda_1 * W`` in one batched
:func:`spectral_ops.spectral_decay_` call per group (same shapes share a batch); vectors
(biases, norm gains) get only the ordinary term, since ``S_p`` is defined for matrices. A matrix
spread over processes is decayed on its owner (:func:`spectral_ops.optim.distributed.owner_decay`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math

import torch

from .. import decay_options, deprecations
from .._checks import check_same_device
from ..decay import DecayOptions, PendingWrite, check_decay_options, prepare_decay, row_block
from ..matrix_views import as_matrices, unambiguous_view
from ..plan import is_prox, is_zero, needs_direction, plain_factor
from .distributed import local, owner_decay


def decay_keywords(after: str, positional: int | None = None, **defaults):
    """Give the decorated ``__init__`` of an optimizer of the family the decay's options
    (:data:`~spectral_ops.decay_options.DECAY_OPTIONS`) as parameters, after its own parameter ``after``:
    the first ``positional`` of them (None: all) positional-or-keyword, the others keyword-only, with the
    table's defaults (``defaults``: the optimizer's own, for some), and its deprecated names
    (:mod:`spectral_ops.deprecations`) as keyword-only ones. The function takes them as ``**decay``: every
    option, given or defaulted, and an old name where it is given.

    A call reads the table as it is then (an option added to it is taken at once); ``inspect.signature``
    and ``help`` show it as it was at import."""
    unknown = set(defaults) - set(decay_options.decay_option_keys())
    if unknown:
        raise TypeError(f"decay_keywords: {sorted(unknown)} are not decay options")

    def decorate(init):
        owner = init.__qualname__.split(".")[0]

        @functools.wraps(init)
        def init_with_decay_options(self, *args, **kwargs):
            names = deprecations.class_names(type(self))
            signature = _signature(init, after, positional, defaults, names)
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError as error:  # bind's message names no function, and suggests nothing
                raise TypeError(f"{type(self).__name__}.__init__() {error}{_close_names(kwargs, signature)}") from None
            bound.apply_defaults()
            renamed = {rename.old for rename in deprecations.optimizer_renames(names)}
            init(**{key: value for key, value in bound.arguments.items() if key not in renamed or value is not None})

        init_with_decay_options.__signature__ = _signature(init, after, positional, defaults,
                                                           {owner, deprecations.OPTIMIZER_FAMILY})
        return init_with_decay_options

    return decorate


def _close_names(kwargs: dict, signature: inspect.Signature) -> str:
    """``"; did you mean ...?"`` for the keywords in ``kwargs`` the signature does not take, where it
    takes a close one."""
    known = list(signature.parameters)
    close = {name: difflib.get_close_matches(name, known, n=1) for name in kwargs if name not in known}
    hints = [f"{close[name][0]!r} for {name!r}" for name in close if close[name]]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _signature(init, after: str, positional: int | None, defaults: dict, names) -> inspect.Signature:
    own = inspect.signature(init)
    parameters = [parameter for parameter in own.parameters.values() if parameter.kind != parameter.VAR_KEYWORD]
    split = [parameter.name for parameter in parameters].index(after) + 1
    options = [inspect.Parameter(option.key, inspect.Parameter.POSITIONAL_OR_KEYWORD if positional is None or
                                 index < positional else inspect.Parameter.KEYWORD_ONLY,
                                 default=defaults.get(option.key, option.default))
               for index, option in enumerate(decay_options.DECAY_OPTIONS)]
    renamed = [inspect.Parameter(rename.old, inspect.Parameter.KEYWORD_ONLY, default=None)
               for rename in deprecations.optimizer_renames(names)]
    ordered = parameters[:split] + options + parameters[split:] + renamed
    # Positional parameters first, in their order; then the keyword-only ones.
    return own.replace(parameters=[parameter for parameter in ordered if parameter.kind != parameter.KEYWORD_ONLY]
                       + [parameter for parameter in ordered if parameter.kind == parameter.KEYWORD_ONLY])


def capturable(group: dict) -> bool:
    """The group's ``capturable`` as a plain bool: torch.compile from 2.15 traces it as a stand-in with a
    truth value but no ``not`` or ``==``."""
    return bool(group["capturable"])


def forbids_host_reads(group: dict) -> bool:
    """Whether the group's step may not read the host, which the stability policies ``"raise"`` and
    ``"warn"`` need: where it is capturable, except while torch.compile traces it. Dynamo traces every
    step as capturable (it sets the key, for torch's optimizers and ours), and a compiled step may
    still read the host, at a graph break."""
    return capturable(group) and not torch.compiler.is_compiling()


def check_decay_group(group: dict, *, spectral: str, ordinary: str) -> DecayOptions:
    """Validate a group's decay options (its keys of :data:`~spectral_ops.decay_options.DECAY_OPTIONS`), naming
    its coefficient keys ``spectral`` and ``ordinary``."""
    keywords = {option.op_keyword: group[option.key] for option in decay_options.DECAY_OPTIONS
                if option.key not in ("p", spectral)}
    options = check_decay_options(group["p"], group[spectral], ordinary_weight_decay=group[ordinary],
                                  capturable=forbids_host_reads(group), names=(spectral, ordinary), **keywords)
    spectral_direction = needs_direction(options.p, group[spectral], options.band)
    for index, param in enumerate(group["params"]):
        if spectral_direction:
            check_matrices_said(param, group, index, "its spectral decay")
        if spectral_direction and param.is_complex() and param.ndim >= 2:
            raise TypeError(f"a complex {tuple(param.shape)} parameter cannot take the spectral decay (p={options.p}"
                            f"{', band' if options.band is not None else ''}): S_p is implemented for real matrices "
                            f"only. Put it in a group with p=1 or {spectral}=0 (the ordinary decay works on it)")
    check_same_device([param for param in group["params"] if param.ndim >= 2], "a parameter group's matrices")
    return options


def check_cautious(group: dict) -> None:
    """A cautious group (SPEC 11) masks each decay term ``lambda T`` it adds to the update by the sign of
    ``u * T``: refused where the decay is no such term (``p0_mode="prox"``, the exact soft-threshold at
    ``p = 0``, a map of the weights rather than a term added to the update) or where the sign of a
    product is not defined (complex parameters)."""
    if not isinstance(group["cautious"], bool):
        raise TypeError(f"cautious must be True or False, got {group['cautious']!r}")
    if not group["cautious"]:
        return
    if is_prox(group["p"], group["p0_mode"], group["band"]):
        raise ValueError("cautious=True masks the decay term lambda_0 * S_0(W) added to the update, where it "
                         "agrees in sign with the update; p0_mode='prox' soft-thresholds the spectrum instead (no "
                         "such term): use p0_mode='explicit' with cautious=True, or cautious=False")
    complex_param = next((param for param in group["params"] if param.is_complex()), None)
    if complex_param is not None:
        raise TypeError(f"cautious=True compares the signs of the update and of the decay, which a complex "
                        f"{tuple(complex_param.shape)} parameter does not have: put it in a group with "
                        "cautious=False")


def matrix_view_of_parameter(param: torch.Tensor, group: dict) -> str:
    """How a step reads ``param``'s matrices: its group's ``matrix_view``, else the evident reading
    (:func:`unambiguous_view`), else ``"batch"`` (a group that does not say holds no parameter whose
    reading matters to it: :func:`check_matrices_said`; element-wise work reads any the same)."""
    return group["matrix_view"] or unambiguous_view(param.shape) or "batch"


def check_matrices_said(param: torch.Tensor, group: dict, index: int, reader: str) -> None:
    """A parameter of more than two dimensions needs its group's ``matrix_view``, unless its reading is
    evident (:func:`unambiguous_view`): the two readings give different maths (SPEC 1.8), and
    neither is safe to guess. ``reader``: what reads its matrices."""
    if group["matrix_view"] is not None or unambiguous_view(param.shape) is not None:
        return
    names = group.get("param_names")
    name = f"parameter {names[index]!r}" if names else f"parameter {index} of its group"
    raise ValueError(
        f"{name} has shape {tuple(param.shape)}: say which matrices {reader} reads in it with the group key "
        "matrix_view: 'batch' (leading dims index independent matrices: MoE experts, heads, parameter banks) or "
        "'flatten' (one matrix, dim 0's rows by the other sizes: conv filters). "
        "spectral_ops.optim.param_groups_by_module(model) sets it per module")


def check_replicas_round_alike(group: dict, params, layouts, ordinary) -> None:
    """Stochastic rounding draws its bits on the rank that computes a decay. A matrix replicated on
    every rank (DDP, a ``Replicate()`` DTensor) is decayed on its owner, whose result every rank takes;
    a replicated vector is decayed by each rank itself, so its replicas would round apart and drift:
    refused, before anything is written."""
    if group["rounding"] != "stochastic" or is_zero(ordinary):
        return
    for param, layout in zip(params, layouts):
        if param.ndim < 2 and layout is not None and layout.replicated:
            raise ValueError(f"rounding='stochastic' would round the {tuple(param.shape)} vector differently on each "
                             "rank that holds a replica of it, and the replicas would drift apart: put the vectors in "
                             "a group with rounding='nearest' (or no weight decay)")


def decay_scale(lr, peak_lr, convention: str):
    """The decay's step size ``s`` from the group's ``lr`` as the step reads it (SPEC 1.5): ``lr`` itself
    under ``convention="decoupled"``, ``eta_t = lr / peak_lr`` (0 when the peak is 0) under
    ``"independent"``. From here to the write the lr travels as ``scale`` (docs/optimizers.md, "Bad
    steps": one record, one commit)."""
    if convention != "independent":
        return lr
    return 0.0 if is_zero(peak_lr) else lr / peak_lr


def decayed_matrices(param: torch.Tensor, view: str, write: PendingWrite, index: int) -> torch.Tensor:
    """``param``'s matrices as its decay reads and writes them: a view of it, or, where its ``"flatten"``
    matrix is no view of it (a channels-last filter), a contiguous copy, which ``write`` copies back
    into it at the commit."""
    if view != "flatten" or param.ndim <= 2 or param.is_contiguous():
        return as_matrices(param, view)
    matrix = param.reshape(param.shape[0], math.prod(param.shape[1:]))  # a copy: no view of it exists
    write.copies.append((index, param, matrix, None))
    return matrix


def row_blocks_of(param: torch.Tensor, blocks) -> list:
    """The ``(start, stop)`` rows of each block the decay takes as matrices of their own in each
    matrix ``param`` holds: ``blocks`` (a function of the parameter giving ``(start, size)`` pairs, or
    None) splits them, as Muon's fused projections are; else the whole matrices (None)."""
    splits = blocks(param) if blocks is not None else None
    return [None] if not splits else [(start, start + size) for start, size in splits]


def matrix_rows(param: torch.Tensor, view: str, rows) -> torch.Tensor:
    """The rows ``rows`` of the matrices ``param`` holds, read as ``view``: a target of its decay, or the
    same view of a tensor laid out as it (:attr:`PendingWrite.views <spectral_ops.decay.PendingWrite>`)."""
    return row_block(as_matrices(param, view), rows)


@torch.no_grad()
def prepare_parameter_decay(params, group: dict, options: DecayOptions, *, scale, spectral, ordinary,
                            blocks=None, layouts=None, exchange=None, increments=False) -> PendingWrite:
    """The group's decay of ``params``, computed from their current values but not written, with the
    group's ``options`` validated beforehand: a :class:`~spectral_ops.decay.PendingWrite` whose owners
    are the positions in ``params``. ``scale``: the decay's step size ``s`` (see
    :func:`decay_scale`). ``blocks``: see :func:`row_blocks_of`. ``layouts``: each parameter's
    :class:`~spectral_ops.optim.distributed.Layout` (None: computed here alone); the spectral direction
    of a spread matrix is computed on its owner through ``exchange``. ``increments``: the increments
    ``-s (lambda_p S_p(W) + lambda_1 W)`` of the pre-step weights instead of the new values, added to
    the weights as they are at the commit (see :class:`~spectral_ops.decay.PendingWrite`).

    A ``cautious`` group (SPEC 11) takes the increments, each term its own (the spectral
    ``-s lambda_p S_p(W)`` and the ordinary ``-s lambda_1 W``; one where they share ``W``'s direction,
    ``p = 1``), since each is masked by its own agreement with the step's update, after that update."""
    cautious = bool(group["cautious"])
    increments = increments or cautious
    layouts = layouts or [None] * len(params)
    write = PendingWrite(group=group, params=list(params), stochastic=increments and options.rounding == "stochastic")
    if write.stochastic and any(layout is not None and layout.replicated for layout in layouts):
        raise ValueError("rounding='stochastic' in a SpectralDecay attached to another optimizer rounds the addition "
                         "of the decay on each rank that holds a replica of a weight, and the replicas would drift "
                         "apart: put the replicated weights in a group with rounding='nearest'")
    if increments:  # rounded once more as it is added: to nearest here, the group's way there
        options = dataclasses.replace(options, rounding="nearest")
    views = [matrix_view_of_parameter(param, group) for param in params]
    matrices = [i for i, param in enumerate(params) if param.ndim >= 2]
    direction = needs_direction(options.p, spectral, options.band)
    # A cautious matrix's ordinary term, where its spectral one has a direction of its own: decayed as
    # the vectors' is, an increment of its own.
    apart = matrices if cautious and direction and not is_zero(ordinary) else []
    matrix_ordinary = 0.0 if apart else ordinary
    if matrices and not (is_zero(spectral) and is_zero(matrix_ordinary) and group["band"] is None):
        arguments = dict(scale=scale, spectral_weight_decay=spectral, ordinary_weight_decay=matrix_ordinary,
                         capturable=capturable(group), increment=increments)
        # On their owners: spread matrices that need whole-matrix work, and replicated ones rounded
        # stochastically (one draw of the bits, which every rank then takes).
        spread = [i for i in matrices if layouts[i] is not None
                  and (direction or (options.rounding == "stochastic" and layouts[i].replicated))]
        for view in dict.fromkeys(views[i] for i in spread):
            alike = [i for i in spread if views[i] == view]
            entries = [(k, rows) for k, i in enumerate(alike) for rows in row_blocks_of(params[i], blocks)]
            owner_decay(exchange, write, [local(params[i]) for i in alike], [layouts[i] for i in alike], entries,
                        alike, options, arguments, matrix_view=view, eager=not capturable(group))
        matrices = [i for i in matrices if i not in spread]
        entries = [(i, rows) for i in matrices for rows in row_blocks_of(params[i], blocks)]
        if entries:
            whole = {i: decayed_matrices(local(params[i]), views[i], write, i) for i in matrices}
            tensors = [row_block(whole[i], rows) for i, rows in entries]
            first, copied = len(write.tensors), {id(matrix) for _, _, matrix, _ in write.copies}
            write.include(prepare_decay(tensors, options, **arguments), [i for i, _ in entries],
                          [rows for _, rows in entries])
            write.views.update((first + k, functools.partial(matrix_rows, view=views[i], rows=rows))
                               for k, (i, rows) in enumerate(entries) if id(whole[i]) not in copied)
    vectors = [i for i, param in enumerate(params) if param.ndim < 2]
    check_replicas_round_alike(group, [params[i] for i in vectors], [layouts[i] for i in vectors], ordinary)
    ordinary_alone = vectors + apart
    if ordinary_alone and not is_zero(ordinary):
        if options.rounding == "stochastic":  # rounded by the decay's epilogue, which writes matrices
            part = prepare_decay([local(params[i]).view(1, -1) for i in ordinary_alone], options, scale=scale,
                                 spectral_weight_decay=0.0, ordinary_weight_decay=ordinary,
                                 capturable=capturable(group))
        else:
            tensors = [local(params[i]) for i in ordinary_alone]
            part = PendingWrite(tensors, factors=dict.fromkeys(range(len(ordinary_alone)),
                                                               plain_factor(scale, 0.0, ordinary, increments)))
        write.include(part, ordinary_alone)
    if increments:
        write.as_increments()
    write.cautious = cautious
    return write
