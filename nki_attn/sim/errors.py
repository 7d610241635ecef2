"""The one exception type the simulator raises for hardware-limit and API-contract violations.

Named after the public ``NkiValidationError`` so code that catches it by name keeps working. Every message
names the instruction, the operand, the offending value and the limit, so a kernel author can fix the call
without reading the simulator.
"""


class NkiValidationError(Exception):
    """A kernel asked for something the NKI compiler or the hardware does not accept."""


def fail(instr, operand, message):
    """Raise ``NkiValidationError`` with the uniform ``instr: operand ...`` prefix."""
    where = f"{instr}: {operand}" if operand else f"{instr}"
    raise NkiValidationError(f"{where}: {message}")
