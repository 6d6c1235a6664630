import math
import random

import pytest

from planner.workload import Z_P99, LengthDistribution, Workload


def test_lognormal_sigma_from_median_and_p99():
    d = LengthDistribution.lognormal(median=3000, p99=24000, max_tokens=30000)
    assert Z_P99 == pytest.approx(2.3263478740408408)
    assert d.sigma == pytest.approx(math.log(8) / Z_P99)
    assert d.quantile(0.5) == 3000
    assert d.quantile(0.99) == 24000


def test_lognormal_samples_match_quantiles_and_mean():
    d = LengthDistribution.lognormal(median=3000, p99=24000, max_tokens=30000)
    xs = sorted(d.sample_many(random.Random(7), 50_000))
    assert 2900 < xs[len(xs) // 2] < 3100
    assert 22_000 < xs[int(0.99 * len(xs))] < 26_000
    assert max(xs) == 30000 and min(xs) >= 1  # clamped, and the cap is reached
    assert sum(xs) / len(xs) == pytest.approx(d.mean_tokens(), rel=0.02)
    assert sum(x == 30000 for x in xs) / len(xs) == pytest.approx(d.truncated_fraction(), abs=0.002)


@pytest.mark.parametrize(("median", "p99", "cap"), [(3000, 24000, 30000), (1000, 8000, 32768), (500, 16000, 65536)])
def test_second_moment_is_the_capped_distributions_whatever_its_tail(median, p99, cap):
    """E[L^2] sets the cost model's contexts. A quadrature over 400 quantiles (what the search used) lost 4-8% of it
    for an uncapped lognormal tail, and half of it for a histogram with 0.1% of long responses."""
    d = LengthDistribution.lognormal(median=median, p99=p99, max_tokens=cap)
    xs = d.sample_many(random.Random(11), 400_000)
    assert sum(x * x for x in xs) / len(xs) == pytest.approx(d.second_moment_tokens(), rel=0.03)
    quadrature = sum(d.quantile((i + 0.5) / 400) ** 2 for i in range(400)) / 400
    if cap >= 32768:  # the tail past the 400th quantile is not cut by the cap: the old figure was low
        assert quadrature < 0.97 * d.second_moment_tokens()
    rare = LengthDistribution.empirical(histogram=[(500, 999), (16384, 1)], max_tokens=16384)
    assert rare.second_moment_tokens() == pytest.approx((500**2 * 999 + 16384**2) / 1000)
    assert LengthDistribution.lognormal(median=50, p99=50, max_tokens=40).second_moment_tokens() == 40**2


def test_truncated_fraction_is_what_sampling_cuts_at_the_edges():
    assert LengthDistribution.lognormal(median=999.7, p99=999.7, max_tokens=1000).truncated_fraction() == 1.0
    same = LengthDistribution.lognormal(median=30, p99=300, max_tokens=50, min_tokens=50)
    assert set(same.sample_many(random.Random(0), 100)) == {50} and same.truncated_fraction() == 1.0


def test_sampling_is_deterministic_and_sample_many_equals_sample():
    d = LengthDistribution.lognormal(median=100, p99=900, max_tokens=1000)
    a = d.sample_many(random.Random(3), 100)
    rng = random.Random(3)
    assert a == [d.sample(rng) for _ in range(100)]


def test_sample_many_is_the_same_through_the_public_inverse_cdf_and_draws_as_sample_does(monkeypatch):
    import statistics

    import planner.workload as workload

    d = LengthDistribution.lognormal(median=100, p99=900, max_tokens=1000)
    expected = d.sample_many(random.Random(3), 100)
    monkeypatch.setattr(workload, "_inv_cdf", lambda p, mu, sigma: statistics.NormalDist(mu, sigma).inv_cdf(p))
    assert d.sample_many(random.Random(3), 100) == expected  # the fallback where the C function is missing
    point = LengthDistribution.lognormal(median=50, p99=50, max_tokens=100)
    many, one = random.Random(5), random.Random(5)
    assert point.sample_many(many, 7) == [point.sample(one) for _ in range(7)]
    assert many.random() == one.random()  # a point mass consumes one draw per length too


def test_point_mass_lognormal():
    d = LengthDistribution.lognormal(median=50, p99=50, max_tokens=100)
    assert d.sample_many(random.Random(0), 5) == [50] * 5
    assert d.mean_tokens() == 50


def test_empirical_histogram():
    d = LengthDistribution.empirical(histogram=[(10, 1), (20, 3), (5000, 1)], max_tokens=1000)
    assert d.lengths == (10, 20, 1000)
    assert d.mean_tokens() == pytest.approx((10 + 60 + 1000) / 5)
    assert d.quantile(0.5) == 20
    assert d.truncated_fraction() == pytest.approx(0.2)
    xs = d.sample_many(random.Random(1), 10_000)
    assert set(xs) == {10, 20, 1000}
    assert xs.count(20) / len(xs) == pytest.approx(0.6, abs=0.03)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"median": 0, "p99": 5, "max_tokens": 10}, "0 < median <= p99"),
        ({"median": 10, "p99": 5, "max_tokens": 10}, "0 < median <= p99"),
        ({"median": 10, "p99": 20, "max_tokens": 10, "min_tokens": 11}, "min_tokens"),
    ],
)
def test_lognormal_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthDistribution.lognormal(**kwargs)


def test_empirical_rejects_bad_histograms():
    with pytest.raises(ValueError, match="no positive counts"):
        LengthDistribution.empirical(histogram=[(10, 0)], max_tokens=100)
    with pytest.raises(ValueError, match=r"histogram\[1\]: count"):
        LengthDistribution.empirical(histogram=[(10, 1), (20, -1)], max_tokens=100)
    with pytest.raises(ValueError, match=r"histogram\[0\]: length"):
        LengthDistribution.empirical(histogram=[(0, 1)], max_tokens=100)


def test_workload_validates_prompt_tokens():
    d = LengthDistribution.lognormal(median=10, p99=20, max_tokens=100)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Workload(response_length=d, prompt_tokens=0)
