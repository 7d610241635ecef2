"""Harness rows: one ``Case`` per (shape, dtype, feature set), and the presets that list them.

A case describes one forward + backward check in the kernels' layout: q ``[batch, heads, d_head, seqlen_q]``,
k/v ``[batch, kv_heads, d_head, seqlen_k]``. Features: ``causal``, ``window`` (sliding window, causal only),
``sinks`` (sink logits per head), ``packing`` (packed sequences given by ``cu_seqlens``; a gap at the end
leaves query rows that see no key), ``scale`` (non-default softmax scale).

Rows whose lengths are not multiples of 128 (or with ``api=True``) run through the public PyTorch API
(``nki_attn.flash_attn_func`` / ``flash_attn_varlen_func``), whose padding path makes any length legal; they are
compared with the golden on the unpadded problem.
"""
import dataclasses
import json

DTYPES = ("float32", "bfloat16", "float16")
# Every spelling the command lines accept, mapped to the canonical name used in rows and reports.
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16"}
TILE = 128
MIN_SEQLEN = 16  # the feature recipes (three packed sequences, windows) need a few tokens
FEATURES = ("plain", "causal", "window", "gqa", "mqa", "packing", "packing_causal", "sinks", "sinks2", "scale",
            "unequal", "empty_row")


@dataclasses.dataclass(frozen=True)
class Case:
    """One harness row. ``note`` records how the shape was derived (e.g. a model scaled down in seqlen)."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    d_head: int
    dtype: str
    causal: bool = False
    window: int = 0
    num_sinks: int = 0
    cu_seqlens: tuple = ()
    scale: float = 0.0  # 0 means the default 1/sqrt(d_head)
    note: str = ""
    api: bool = False  # run through the public PyTorch API even when the lengths are multiples of 128

    @property
    def via_api(self):
        """True when the row runs through the PyTorch API (any length) instead of the kernels directly."""
        return self.api or self.seqlen_q % TILE != 0 or self.seqlen_k % TILE != 0

    @property
    def features(self):
        f = []
        if self.causal:
            f.append("causal")
        if self.window:
            f.append(f"window{self.window}")
        if self.kv_heads == 1 and self.heads > 1:
            f.append("mqa")
        elif self.kv_heads != self.heads:
            f.append(f"gqa{self.heads // self.kv_heads}:1")
        if self.num_sinks:
            f.append(f"sinks{self.num_sinks}")
        if self.cu_seqlens:
            f.append("packing")
            if self.cu_seqlens[-1] < self.seqlen_q:
                f.append("empty_rows")
        if self.scale:
            f.append(f"scale{self.scale:g}")
        if self.seqlen_q != self.seqlen_k:
            f.append("sq!=sk")
        if self.via_api:
            f.append("api")
        return f or ["plain"]

    def as_dict(self):
        """JSON-ready fields plus the derived ``features`` list (the report's ``case``)."""
        d = dataclasses.asdict(self)
        d["cu_seqlens"] = list(self.cu_seqlens)
        d["features"] = self.features
        return d

    @classmethod
    def from_dict(cls, d):
        """The inverse of ``as_dict`` (derived keys ignored): re-run a report's row, or a property-test example.
        Raises ValueError naming unknown or missing fields."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields - {"features"}
        if unknown:
            raise ValueError(f"unknown case fields {sorted(unknown)}; known: {sorted(fields)}")
        kw = {k: v for k, v in d.items() if k in fields}
        kw["cu_seqlens"] = tuple(kw.get("cu_seqlens", ()))
        try:
            return cls(**kw)
        except TypeError as exc:
            raise ValueError(f"case {d!r}: {exc}") from None

    def to_json(self):
        """One-line JSON of the case, as ``nki-attn check --case`` takes it."""
        d = self.as_dict()
        d.pop("features")
        return json.dumps(d, separators=(",", ":"))


def feature_case(feature, seqlen, d_head, dtype, heads=2, batch=1):
    """The case that exercises one named feature at the given size."""
    s, h = seqlen, heads
    base = dict(batch=batch, heads=h, kv_heads=h, seqlen_q=s, seqlen_k=s, d_head=d_head, dtype=dtype)
    thirds = (0, max(1, s // 3 - 5), s // 3 + s // 2, s)  # three packed sequences of unequal length
    spec = {
        "plain": {},
        "causal": dict(causal=True),
        "window": dict(causal=True, window=max(1, s // 4) + 3),
        "gqa": dict(heads=4 * h, kv_heads=h),
        "mqa": dict(heads=4, kv_heads=1),
        "packing": dict(cu_seqlens=thirds),
        "packing_causal": dict(cu_seqlens=thirds, causal=True),
        "sinks": dict(num_sinks=1, causal=True),
        "sinks2": dict(num_sinks=2),
        "scale": dict(scale=0.3),
        "unequal": dict(seqlen_k=s + 128 if s <= 1024 else s // 2),
        "empty_row": dict(cu_seqlens=(0, s // 2, s - min(64, s // 4))),
    }[feature]
    base.update(spec)
    return Case(name=f"{feature}-s{base['seqlen_q']}-d{d_head}-{dtype}", **base)


def quick():
    """Every feature at small sizes, plus each d_head and dtype, and two lengths that are not multiples of 128
    (through the API's padding path): about half a minute on 2 cores."""
    rows = [feature_case(f, 256, 64, "bfloat16") for f in FEATURES]
    rows += [feature_case("causal", 256, 64, dt) for dt in ("float32", "float16")]
    rows += [feature_case("plain", 256, 64, "float32"), feature_case("sinks", 256, 64, "float16")]
    rows += [feature_case("causal", 256, d, "bfloat16") for d in (96, 128, 256)]
    rows += [feature_case("causal", 300, 64, "bfloat16"), feature_case("packing_causal", 300, 64, "float32")]
    return rows


def full():
    """The feature matrix at realistic sizes (seqlen 2048-16384), every dtype, d_head 64/128/256; and rows of
    1000 and 300 tokens through the API's padding path."""
    rows = []
    for dt in DTYPES:
        rows += [feature_case(f, 2048, 128, dt, heads=1) for f in FEATURES if f not in ("gqa", "mqa")]
        rows += [feature_case(f, 2048, 128, dt, heads=1) for f in ("gqa", "mqa")]
    for d in (64, 256):
        rows += [feature_case("causal", 4096, d, "bfloat16", heads=1)]
    rows += [feature_case("window", 8192, 128, "bfloat16", heads=1)]
    # 16K tokens: several K/V sections in the backward (the float64 golden needs about 9 GB here)
    rows += [feature_case("causal", 16384, 128, "bfloat16", heads=1)]
    # lengths that are not multiples of 128, through the API's padding path, in every dtype
    rows += [feature_case(f, 1000, 128, dt, heads=1) for dt in DTYPES for f in ("causal", "sinks", "packing_causal")]
    rows += [feature_case(f, 1000, 128, "bfloat16", heads=1) for f in ("window", "gqa", "unequal", "empty_row")]
    rows += [feature_case("causal", 300, 64, dt) for dt in DTYPES] + [feature_case("sinks2", 300, 64, "bfloat16")]
    return rows


# (name, heads, kv_heads, d_head, causal, window, sinks, real seqlen)
MODELS = (
    ("llama3-8b", 32, 8, 128, True, 0, 0, 8192),
    ("llama3-70b-tp8", 8, 1, 128, True, 0, 0, 8192),
    ("qwen3-8b", 32, 8, 128, True, 0, 0, 4096),
    ("gemma2-9b-swa", 16, 8, 256, True, 4096, 0, 8192),
    ("gpt-oss-20b-sinks-swa", 64, 8, 64, True, 128, 1, 4096),
    ("modernbert", 16, 16, 64, False, 0, 0, 1024),
    ("mqa-d96", 8, 1, 96, True, 0, 0, 8192),
)


def models(seqlen_cap=4096):
    """Real models' head counts, kv heads, d_head, window and sinks; seqlen capped at ``seqlen_cap`` to fit the
    simulator's time budget of about 10 minutes on 2 cores (the note says so; windows at least as long as
    the cap are scaled down with it)."""
    rows = []
    for name, h, hk, d, causal, window, sinks, real in MODELS:
        s = min(real, seqlen_cap)
        w = window
        note = ""
        if s < real:
            note = f"seqlen scaled down from {real} to {s} for the simulator's time budget"
            if window and window >= s:
                w = s // 4
                note += f"; window scaled from {window} to {w}"
        rows.append(Case(name=f"{name}-s{s}", batch=1, heads=h, kv_heads=hk, seqlen_q=s, seqlen_k=s, d_head=d,
                         dtype="bfloat16", causal=causal, window=w, num_sinks=sinks, note=note))
    return rows


PRESETS = {"quick": quick, "full": full, "models": models}


def parse_shape(spec):
    """Parse one ``--shapes`` entry "SEQLENxD_HEAD" or "SEQLENxD_HEADxHEADS" into (seqlen, d_head, heads).

    Any seqlen >= MIN_SEQLEN is accepted (lengths that are not multiples of 128 run through the API's padding
    path); heads defaults to 2. Raises ValueError naming the entry, the offending value and the rule.
    """
    parts = str(spec).lower().split("x")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {spec!r} must be SEQLENxD_HEAD or SEQLENxD_HEADxHEADS with positive integers, "
                         f"e.g. 1024x128 or 300x64x4")
    s, d = int(parts[0]), int(parts[1])
    h = int(parts[2]) if len(parts) == 3 else 2
    if s < MIN_SEQLEN:
        raise ValueError(f"shape {spec!r}: seqlen {s} must be >= {MIN_SEQLEN}")
    if d < 1:
        raise ValueError(f"shape {spec!r}: d_head {d} must be >= 1")
    if h < 1:
        raise ValueError(f"shape {spec!r}: heads {h} must be >= 1")
    return s, d, h


def canonical_dtype(name):
    """'bf16' / 'bfloat16' -> 'bfloat16' (likewise fp16/float16, fp32/float32); ValueError otherwise."""
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; choose from {sorted(DTYPE_ALIASES)}") from None


def case_from_json(text):
    """A ``Case`` from its JSON (``Case.to_json`` or a report row's ``case``); ValueError when malformed."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"case {text!r} is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"case {text!r} must be a JSON object")
    return Case.from_dict(d)


def select(preset=None, shapes=None, dtypes=None, features=None):
    """Rows of a preset, or rows built from ``shapes`` ("SEQLENxD_HEAD[xHEADS]" strings or (seqlen, d_head,
    heads) tuples) x ``dtypes`` x ``features``; with a preset, ``dtypes``/``features`` filter its rows. Dtypes
    may use either spelling (bf16 or bfloat16)."""
    dtypes = [canonical_dtype(d) for d in dtypes] if dtypes else None
    for f in features or ():
        if f not in FEATURES:
            raise ValueError(f"unknown feature {f!r}; choose from {FEATURES}")
    if shapes:
        feats = features or ["plain", "causal"]
        dts = dtypes or ["bfloat16"]
        rows = []
        for spec in shapes:
            s, d, h = spec if isinstance(spec, tuple) else parse_shape(spec)
            for f in feats:
                rows += [feature_case(f, s, d, dt, heads=h) for dt in dts]
        return rows
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    rows = PRESETS[preset]()
    if dtypes:
        rows = [r for r in rows if r.dtype in dtypes]
    if features:
        rows = [r for r in rows if any(r.name.startswith(f + "-") for f in features)]
    return rows
