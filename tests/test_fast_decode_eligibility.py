"""Which models the decode step's own kernels take (``fast_decode.eligible``): an accepts-list over
every field of the model's spec, so a field added to ``ModelSpec`` or ``Layer`` and left off the
list keeps the model on the general path instead of running on kernels that ignore it."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mooncake.engine.kernels.fast_decode import LAYER_ACCEPTS, MODEL_ACCEPTS, eligible
from mooncake.engine.model.families.spec import Fused, Layer, ModelSpec, RMSNorm

H, HKV, D = 4, 2, 32
HIDDEN = H * D


def spec_of(layer_cls: type = Layer, model_cls: type = ModelSpec, **changes) -> ModelSpec:
    def norm() -> RMSNorm:
        return RMSNorm(torch.ones(HIDDEN), 1e-5)

    def fused(n_out: list[int]) -> Fused:
        return Fused((torch.zeros(sum(n_out), HIDDEN), None), n_out)

    layer = layer_cls(norm(), fused([H * D, HKV * D, HKV * D]), (torch.zeros(HIDDEN, HIDDEN), None), norm(),
                      fused([64, 64]), (torch.zeros(HIDDEN, 64), None), **changes.pop("layer", {}))
    embed = torch.zeros(10, HIDDEN)
    return model_cls(H, HKV, D, HIDDEN, embed, embed, norm(), [layer], F.silu, **changes)


def test_every_field_of_the_spec_is_on_an_accepts_list():
    assert set(MODEL_ACCEPTS) == {f.name for f in dataclasses.fields(ModelSpec)}
    assert set(LAYER_ACCEPTS) == {f.name for f in dataclasses.fields(Layer)}


def test_a_plain_llama_is_eligible_and_what_the_kernels_do_not_do_is_not():
    assert eligible(spec_of(), D)
    assert not eligible(spec_of(), D // 2)  # partial rotary
    assert not eligible(spec_of(attn_softcap=50.0), D)
    assert not eligible(spec_of(embed_scale=11.3), D)
    assert not eligible(spec_of(layer={"q_norm": RMSNorm(torch.ones(D), 1e-5)}), D)
    upcast = spec_of()
    upcast.final_norm = RMSNorm(torch.zeros(HIDDEN), 1e-5, offset=True)  # Gemma's
    assert not eligible(upcast, D)


def test_a_field_the_lists_do_not_name_keeps_the_general_path():
    NewLayer = dataclasses.make_dataclass("NewLayer", [("qk_clip", float | None, None)], bases=(Layer,))
    assert not eligible(spec_of(layer_cls=NewLayer), D)
    NewModel = dataclasses.make_dataclass("NewModel", [("final_logit_bias", float | None, None)], bases=(ModelSpec,))
    assert not eligible(spec_of(model_cls=NewModel), D)
