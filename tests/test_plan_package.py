"""spectral_ops.plan as a package (issue #45): what pickled the plan's records before the split still loads."""

from __future__ import annotations

import pickle

import pytest

from spectral_ops import plan

# Protocol-2 pickles written by the single-module spectral_ops/plan.py (commit 564db84): they name the
# classes as spectral_ops.plan.X, which the package keeps.
OLD_PICKLES = {
    "band": (b'\x80\x02cspectral_ops.plan\nBand\nq\x00)\x81q\x01}q\x02(X\x03\x00\x00\x00tauq\x03G?\xe0\x00\x00\x00\x00'
             b'\x00\x00X\x04\x00\x00\x00modeq\x04X\x08\x00\x00\x00two_bandq\x05X\x05\x00\x00\x00p_botq\x06K\x00X\x19'
             b'\x00\x00\x00spectral_weight_decay_botq\x07G?\xd0\x00\x00\x00\x00\x00\x00X\n\x00\x00\x00sign_stepsq'
             b'\x08NX\x0b\x00\x00\x00sign_methodq\tX\r\x00\x00\x00polar_expressq\nub.',
             plan.Band(0.5, "two_band", p_bot=0, spectral_weight_decay_bot=0.25)),
    "request": (b'\x80\x02cspectral_ops.plan\nDecayRequest\nq\x00)\x81q\x01}q\x02(X\x01\x00\x00\x00pq\x03K\x02X\x05'
                b'\x00\x00\x00scaleq\x04G?\xb9\x99\x99\x99\x99\x99\x9aX\x15\x00\x00\x00spectral_weight_decayq\x05G?'
                b'\xe0\x00\x00\x00\x00\x00\x00X\x15\x00\x00\x00ordinary_weight_decayq\x06G\x00\x00\x00\x00\x00\x00'
                b'\x00\x00X\x04\x00\x00\x00bandq\x07cspectral_ops.plan\nBand\nq\x08)\x81q\t}q\n(X\x03\x00\x00\x00tauq'
                b'\x0bG?\xe0\x00\x00\x00\x00\x00\x00X\x04\x00\x00\x00modeq\x0cX\x03\x00\x00\x00topq\rX\x05\x00\x00'
                b'\x00p_botq\x0eK\x01X\x19\x00\x00\x00spectral_weight_decay_botq\x0fG\x00\x00\x00\x00\x00\x00\x00'
                b'\x00X\n\x00\x00\x00sign_stepsq\x10NX\x0b\x00\x00\x00sign_methodq\x11X\r\x00\x00\x00polar_expressq'
                b'\x12ubX\x07\x00\x00\x00p0_modeq\x13X\x08\x00\x00\x00explicitq\x14X\x12\x00\x00\x00'
                b'polar_coefficientsq\x15)X\x11\x00\x00\x00sign_coefficientsq\x16)X\t\x00\x00\x00precisionq\x17NX\t'
                b'\x00\x00\x00iterationq\x18X\x04\x00\x00\x00autoq\x19X\t\x00\x00\x00stabilityq\x1aX\x06\x00\x00\x00'
                b'ignoreq\x1bX\n\x00\x00\x00capturableq\x1c\x89X\x06\x00\x00\x00methodq\x1dX\x04\x00\x00\x00gramq'
                b'\x1eX\t\x00\x00\x00incrementq\x1f\x89X\x08\x00\x00\x00roundingq X\x07\x00\x00\x00nearestq!X\t\x00'
                b'\x00\x00generatorq"NX\x0f\x00\x00\x00threshold_ratioq#Nub.',
                plan.DecayRequest(2, 0.1, 0.5, band=plan.Band(0.5))),
    "route": (b'\x80\x02cspectral_ops.plan\nRoute\nq\x00)\x81q\x01}q\x02(X\x06\x00\x00\x00methodq\x03X\x04\x00\x00'
              b'\x00gramq\x04X\t\x00\x00\x00iterationq\x05X\t\x00\x00\x00rectangleq\x06X\x05\x00\x00\x00chainq\x07'
              b'\x88ub.', plan.Route("gram", "rectangle", True)),
    "design": (b'\x80\x02cspectral_ops.plan\nThresholdDesign\nq\x00)\x81q\x01}q\x02(X\x08\x00\x00\x00absoluteq\x03'
               b'\x88X\x04\x00\x00\x00signq\x04G?\xf0\x00\x00\x00\x00\x00\x00G\x00\x00\x00\x00\x00\x00\x00\x00G\x00'
               b'\x00\x00\x00\x00\x00\x00\x00\x87q\x05\x85q\x06X\x05\x00\x00\x00polarq\x07G@\x00\x00\x00\x00\x00\x00'
               b'\x00G\x00\x00\x00\x00\x00\x00\x00\x00G\x00\x00\x00\x00\x00\x00\x00\x00\x87q\x08\x85q\tX\x06\x00\x00'
               b'\x00cutoffq\nNub.', plan.ThresholdDesign(True, ((1.0, 0.0, 0.0),), ((2.0, 0.0, 0.0),))),
}


@pytest.mark.parametrize("name", list(OLD_PICKLES))
def test_a_record_pickled_by_the_single_module_plan_loads(name):
    data, expected = OLD_PICKLES[name]
    assert pickle.loads(data) == expected


def test_a_stability_error_pickled_by_the_single_module_plan_loads_and_round_trips():
    old = pickle.loads(b'\x80\x02cspectral_ops.plan\nSpectralStabilityError\nq\x00X\x08\x00\x00\x00unstableq\x01'
                       b'\x85q\x02Rq\x03.')
    assert isinstance(old, plan.SpectralStabilityError) and old.args == ("unstable",)
    again = pickle.loads(pickle.dumps(plan.DecayRequest(3, 0.1, 0.5, band=plan.Band(0.5, "bot"))))
    assert again == plan.DecayRequest(3, 0.1, 0.5, band=plan.Band(0.5, "bot"))
