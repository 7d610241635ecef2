"""The terminal summary of `nki-attn check`: a run with rows the candidate refused says how many were judged, and
refusal messages are shortened at word boundaries, never mid-word."""
import pytest

from nki_attn.harness import report

MESSAGE = ("attention_bwd() got an unexpected keyword argument 'softcap' (the candidate's signature has no "
           "softcap parameter, so every row that uses soft-capping is reported as unsupported rather than failed)")


def _row(name, status, error=None):
    out = {"max_abs": 1e-3, "bound": 1e-2, "ok": True}
    row = {"case": {"name": name}, "status": status, "pass": status == "pass",
           "outputs": {} if error else {"o": out, "dq": out}}
    if error:
        row["error"] = error
    else:
        row["worst_ratio"] = 0.1
    return row


def _table(rows):
    return report.table(report.build(rows, {"candidate": "bwd my.py:bwd"}))


def test_unsupported_rows_are_counted_in_the_verdict():
    rows = [_row(f"r{i}", "pass") for i in range(25)] + [_row(f"u{i}", "unsupported", MESSAGE) for i in range(13)]
    text = _table(rows)
    assert "OVERALL: PASS (25 rows; 13 unsupported) (candidate: bwd my.py:bwd)" in text
    assert "OVERALL: PASS (candidate" not in text


def test_one_judged_row_is_singular():
    assert "OVERALL: PASS (1 row; 2 unsupported)" in _table([_row("r0", "pass")] + [_row("u", "unsupported", "no")] * 2)


def test_without_unsupported_rows_the_verdict_is_unchanged():
    text = _table([_row("r0", "pass"), _row("r1", "fail")])
    assert text.splitlines()[-1] == "OVERALL: FAIL (candidate: bwd my.py:bwd)"


def test_refusal_messages_are_cut_between_words():
    text = _table([_row("r0", "pass"), _row("u0", "unsupported", MESSAGE)])
    line = next(x for x in text.splitlines() if x.startswith("u0"))
    shown = line.split("UNSUPPORTED ", 1)[1]
    assert shown.endswith("...") and len(shown) <= 160
    kept = shown[:-3].split()
    assert kept == MESSAGE.split()[:len(kept)], "every word shown is a whole word of the message"


@pytest.mark.parametrize("text,width,want", [
    ("short message", 40, "short message"),
    ("an unexpected keyword argument", 20, "an unexpected..."),
    ("an   unexpected\nkeyword", 40, "an unexpected keyword"),  # whitespace collapsed, nothing cut
    ("unexpected_keyword_argument_without_spaces", 10, "unexpected_keyword_argument_without_spaces"),
    ("unexpected_keyword_argument and more", 10, "unexpected_keyword_argument..."),
])
def test_clip(text, width, want):
    assert report.clip(text, width) == want
