"""A PipelineJob's model from its spec: a torchvision classifier by name, pipejob's own
transformer language model, or the user's factory. Seeded, so every build is the same."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipejob.core.common_spec import spec_key
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.core.workload import Model
from pipejob.trainer.runtime.json_values import JsonObject, JsonValue
from pipejob.trainer.workloads import imports, materialize, staged
from pipejob.trainer.workloads.transformer import TransformerLM


def build(spec: PipelineSpec) -> nn.Module:
    """The job's model, initialised from spec.seed."""
    torch.manual_seed(spec.seed)
    model = spec.model
    if model.torchvision is not None:
        from torchvision.models import get_model

        return get_model(model.torchvision, weights=None, num_classes=spec.num_classes)
    if model.transformer is not None:
        return TransformerLM(model.transformer)
    if model.import_ is None:  # the user's function builds the stages: the model is them
        return staged.whole(spec)
    return imports.module(model.import_, "spec.model.import", model.args)


def build_meta(spec: PipelineSpec) -> tuple[nn.Module, materialize.Numbering]:
    """The job's model with none of its parameters in memory (on the meta device; buffers
    are built), as a plan needs it, and per registration number the names of each parameter
    and what its value is computed from (materialize.numbering), by which a process is told
    which to build."""
    model, registered = materialize.build(lambda: build(spec), ())
    return model, materialize.numbering(model, registered)


def as_spec(model: Model) -> JsonObject:
    """The model's section as the spec writes it (camelCase, set fields only)."""

    def plain(value: object) -> JsonValue:
        if dataclasses.is_dataclass(value):
            return {
                spec_key(f.name): plain(getattr(value, f.name))
                for f in dataclasses.fields(value)
                if getattr(value, f.name) not in (None, {}, ())
            }
        return list(value) if isinstance(value, tuple) else value  # as JSON reads it back

    section = plain(model)  # a dataclass: an object
    assert isinstance(section, dict)
    return section


def name(model: Model) -> str:
    """How the logs and the summary call the model."""
    if model.torchvision is not None:
        return model.torchvision
    if model.transformer is not None:
        t = model.transformer
        return f"transformer ({t.layers} layers, width {t.width}, {t.heads} heads)"
    if model.import_ is None and model.staged is not None:
        return f"the stages of {model.staged.stage}"
    return str(model.import_)
