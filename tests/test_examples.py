"""Each example runs at reduced size and writes its plot."""

import pathlib
import sys

import numpy as np
import pytest


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import fit_lotka_volterra  # noqa: E402
import fit_robertson  # noqa: E402
import neural_ode  # noqa: E402
import neural_ode_diffrax_style  # noqa: E402
import swap_from_diffrax  # noqa: E402


# Reverse-mode Jacobians are also compared with forward mode in test_fit.py.
@pytest.mark.parametrize("jac", ["fwd", pytest.param("bwd", marks=pytest.mark.slow)])
def test_fit_lotka_volterra(tmp_path, jac):
    png = tmp_path / "lv.png"
    results = fit_lotka_volterra.main(n=16, jacs=(jac,), plot_path=png)
    assert png.stat().st_size > 0
    r = results[jac]
    assert r["success"] and r["diffrax_success"]
    assert r["max_relative_error"] < 0.02
    assert r["agreement"] < 1e-6
    np.testing.assert_allclose(r["params"], r["diffrax_params"], rtol=1e-6)


@pytest.mark.slow
def test_neural_ode(tmp_path):
    png = tmp_path / "node.png"
    out = neural_ode.main(steps=40, n=4, plot_path=png)
    assert png.stat().st_size > 0
    assert out["losses"][-1] < out["losses"][0] / 2
    # Every step used a mesh that met the training tolerance; stale meshes were
    # recorded again, and the padded meshes kept one compiled training step.
    assert max(out["ratios"]) <= neural_ode.STALE
    assert out["records"] >= 2
    assert out["mesh_lengths"] == [neural_ode.MESH_STEPS]


@pytest.mark.slow
def test_neural_ode_trained_the_diffrax_way():
    out = neural_ode_diffrax_style.main(
        steps=4, batch=4, width=8, size=16, length=20, record_every=2
    )
    for ours, theirs in zip(out["swapped"], out["diffrax"]):
        # The same weights and batches: the first loss agrees to float32 round-off;
        # later ones drift as the optimiser turns gradient round-off into updates.
        np.testing.assert_allclose(ours["losses"][0], theirs["losses"][0], rtol=1e-5)
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-3)
    for phase in out["mesh"]:
        assert phase["records"] >= 1 and np.all(np.isfinite(phase["losses"]))


def test_swap_from_diffrax():
    assert swap_from_diffrax.main() < 1e-9


@pytest.mark.slow
def test_fit_robertson(tmp_path):
    # Rates eleven decades apart, recorded and replayed with gs.Rodas5; the data come
    # from Diffrax's Kvaerno5 at rtol = 1e-10 with the true rates.
    png = tmp_path / "rob.png"
    out = fit_robertson.main(experiments=2, num_times=10, plot_path=png)
    assert png.stat().st_size > 0
    assert out["success"]
    assert out["max_relative_error"] < 0.05
    # One compiled program (meshes="auto" with Levenberg-Marquardt): every
    # evaluation replays a mesh recorded at its own parameters, never a stale one.
    assert out["stats"]["rounds"] == 1 and out["stats"]["stale_meshes"] == 0
