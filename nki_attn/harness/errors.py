"""The two ways a call into a candidate can go wrong, shared by ``candidate`` (which raises them) and ``runner``
(which turns them into a row's status) without either importing the other's machinery."""


class Unsupported(Exception):
    """The candidate refused a row's arguments (``candidate``'s module docstring says what counts as a refusal)."""


class CandidateError(Exception):
    """The candidate broke the calling contract (e.g. returned the wrong number of outputs): a failing row."""
