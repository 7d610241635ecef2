"""NKI data types for the simulator.

A dtype is a ``str`` subclass whose value is its public name (``str(nl.bfloat16) == "bfloat16"``), because
public kernels compare dtypes through ``str()``. Each carries the numpy/ml_dtypes type used to store it.
"""
import ml_dtypes
import numpy as np


class NkiDType(str):
    """A named NKI dtype. ``np`` is the storage type, ``kind`` one of ``float``, ``int``, ``bool``."""

    def __new__(cls, name, np_type, kind):
        obj = super().__new__(cls, name)
        obj.np = np.dtype(np_type)
        obj.kind = kind
        obj.itemsize = obj.np.itemsize
        return obj

    @property
    def is_float(self):
        return self.kind == "float"

    @property
    def is_int(self):
        return self.kind in ("int", "bool")

    def __repr__(self):
        return f"nl.{str.__str__(self)}"

    def __reduce__(self):
        return (_by_name, (str.__str__(self),))


float32 = NkiDType("float32", np.float32, "float")
tfloat32 = NkiDType("tfloat32", np.float32, "float")
bfloat16 = NkiDType("bfloat16", ml_dtypes.bfloat16, "float")
float16 = NkiDType("float16", np.float16, "float")
# The legacy float8_e4m3 is IEEE-like (has inf); the OCP "fn" variant has none. Which ml_dtypes type backs the
# legacy one is undocumented; ml_dtypes.float8_e4m3 is the IEEE-like one.
float8_e4m3 = NkiDType("float8_e4m3", ml_dtypes.float8_e4m3, "float")
float8_e4m3fn = NkiDType("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "float")
float8_e5m2 = NkiDType("float8_e5m2", ml_dtypes.float8_e5m2, "float")
float8_e8m0fnu = NkiDType("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, "float")
int8 = NkiDType("int8", np.int8, "int")
int16 = NkiDType("int16", np.int16, "int")
int32 = NkiDType("int32", np.int32, "int")
uint8 = NkiDType("uint8", np.uint8, "int")
uint16 = NkiDType("uint16", np.uint16, "int")
uint32 = NkiDType("uint32", np.uint32, "int")
bool_ = NkiDType("bool_", np.uint8, "bool")

ALL = (float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
       int8, int16, int32, uint8, uint16, uint32, bool_)
_BY_NAME = {str.__str__(d): d for d in ALL}
_BY_NAME["bool"] = bool_
_FROM_NP = {}
for _d in ALL:
    if _d not in (tfloat32, bool_):
        _FROM_NP.setdefault(_d.np, _d)
_FROM_NP[np.dtype(np.bool_)] = bool_

LOW_PRECISION_FLOATS = (bfloat16, float16, tfloat32, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)


def _by_name(name):
    return _BY_NAME[name]


def as_dtype(dt):
    """Normalise an NKI dtype, its name, a numpy dtype or a torch dtype to an ``NkiDType``."""
    if isinstance(dt, NkiDType):
        return dt
    if isinstance(dt, str):
        if dt in _BY_NAME:
            return _BY_NAME[dt]
        raise TypeError(f"unknown NKI dtype name {dt!r}")
    torch_name = getattr(dt, "is_floating_point", None)
    if torch_name is not None and type(dt).__module__ == "torch":
        name = str(dt).replace("torch.", "")
        if name == "bool":
            return bool_
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise TypeError(f"torch dtype {dt} has no NKI equivalent")
    try:
        npd = np.dtype(dt)
    except TypeError as exc:
        raise TypeError(f"cannot interpret {dt!r} as an NKI dtype") from exc
    if npd in _FROM_NP:
        return _FROM_NP[npd]
    raise TypeError(f"numpy dtype {npd} has no NKI equivalent")


def int_range(dt):
    """(min, max) representable by an integer dtype."""
    info = np.iinfo(dt.np)
    return info.min, info.max
