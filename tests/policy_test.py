"""Policies: construction, string round trip, resolution and its errors."""

import jax
import jax.numpy as jnp
import pytest

from lowprec import ops
from lowprec.backward.policy import ALL_USES, USES, VALUES, Policy

ROUND_TRIP = {
  "attention": "attn.probs@dv=rounded,attn.probs@dscores=original,"
  "attn.out@delta=fresh",
  "regex": r"norm\.out@d(gain|x)=original,.*@dw=rounded,.*=nearest",
  "one_rule": ".*=original",
  "empty": "",
}


@pytest.mark.parametrize("text", ROUND_TRIP.values(), ids=ROUND_TRIP.keys())
def test_string_form_round_trips(text):
  p = Policy.parse(text)
  assert str(p) == text
  assert Policy.parse(str(p)) == p
  assert eval(repr(p), {"Policy": Policy.parse}) == p


def test_dict_rules_and_string_build_the_same_policy():
  rules = [("norm.out@dw", "rounded"), ("norm.out@.*", "original")]
  a = Policy.parse(dict(rules))
  b = Policy.parse(rules)
  c = Policy.parse(" norm.out@dw = rounded , norm.out@.*=original ")
  assert a == b == c
  assert hash(a) == hash(c)
  assert Policy.parse(a) is a


def test_first_matching_rule_wins():
  p = Policy.parse("attn.probs@dv=rounded,attn.*=fresh,.*=original")
  assert p.resolve("attention") == {
    "attn.probs@dv": "rounded",
    "attn.probs@dscores": "fresh",
    "attn.out@delta": "fresh",
  }
  later = Policy.parse("attn.*=fresh,attn.probs@dv=rounded")
  assert later.resolve("attention")["attn.probs@dv"] == "fresh"


def test_override_puts_new_rules_first():
  p = ops.REFERENCE.override({"attn.out@delta": "fresh"})
  assert p.resolve("attention")["attn.out@delta"] == "fresh"
  assert p.resolve("attention")["attn.probs@dv"] == "rounded"


def test_one_policy_covers_several_operators():
  p = Policy.parse(".*@dw=rounded,dense.kernel@dx=rounded,.*=original")
  assert p.resolve("dense") == {
    "dense.in@dw": "rounded",
    "dense.kernel@dx": "rounded",
  }
  assert p.resolve("norm_dense")["norm.out@dgain"] == "original"
  # A rule naming another operator's use is fine for this operator.
  q = Policy.parse("attn.probs@dv=rounded,.*=original")
  assert q.resolve("activation") == {"act.in@dact": "original"}


def test_policy_is_a_static_jit_argument():
  calls = []

  def f(x, policy):
    calls.append(policy)
    return x * len(policy.resolve("dense"))

  g = jax.jit(f, static_argnums=1)
  p = Policy.parse(".*=rounded")
  assert float(g(jnp.float32(2), p)) == 4.0
  assert float(g(jnp.float32(3), Policy.parse(".*=rounded"))) == 6.0
  assert len(calls) == 1  # equal policies hash equal: no retrace


def test_uncovered_use_lists_the_operators_uses():
  p = Policy.parse("attn.probs@dv=rounded,attn.probs@dscores=original")
  with pytest.raises(ValueError) as e:
    p.resolve("attention")
  msg = str(e.value)
  assert "attn.out@delta" in msg
  for use in USES["attention"]:
    assert use in msg


def test_unknown_use_name_is_an_error_with_a_suggestion():
  p = Policy.parse("attn.prob@dv=rounded,.*=original")
  with pytest.raises(ValueError, match="matches no use") as e:
    p.resolve("attention")
  assert "Did you mean 'attn.probs@dv'" in str(e.value)
  assert "attn.out@delta" in str(e.value)  # lists the op's uses


MALFORMED = {
  "no_equals": ("attn.probs@dv", "use=value"),
  "two_equals": ("attn.probs@dv=rounded=fresh", "use=value"),
  "empty_pattern": ("=rounded", "empty use pattern"),
  "unknown_value": ("attn.probs@dv=round", "Did you mean 'rounded'"),
  "bad_regex": ("attn.(probs@dv=rounded", "not a regex"),
  "trailing_comma": ("attn.probs@dv=rounded,", "use=value"),
}


@pytest.mark.parametrize(
  ("text", "match"), MALFORMED.values(), ids=MALFORMED.keys()
)
def test_malformed_policy_strings_are_rejected(text, match):
  with pytest.raises(ValueError, match=match):
    Policy.parse(text)


def test_rule_patterns_cannot_contain_separators():
  with pytest.raises(ValueError, match="separate rules"):
    Policy.parse([("attn.probs@d{1,2}v", "rounded")])


def test_bad_specs():
  with pytest.raises(TypeError):
    Policy.parse(3)
  with pytest.raises(ValueError, match="pair"):
    Policy.parse([("a", "rounded", "x")])
  with pytest.raises(ValueError, match="unknown operator 'atention'"):
    Policy.parse(".*=rounded").resolve("atention")


def test_registry_matches_the_operators_tables():
  assert set(USES) == set(ops.OPS)
  for name, cls in ops.OPS.items():
    assert tuple(r.use for r in cls.table) == USES[name], name
    for r in cls.table:
      assert r.must_read in ("rounded", "original")
  assert set(ALL_USES) == {u for uses in USES.values() for u in uses}
  for name in USES:
    values = ops.REFERENCE.resolve(name)
    assert set(values.values()) <= set(VALUES)
