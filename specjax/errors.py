"""The error a user can fix: a bad argument, file or config value.

The command line prints a `UserError` as one line (`error: ...`) and exits 2; every other exception
is an internal error and keeps its traceback. `UserError` is a `ValueError`, so code that already
catches `ValueError` around user input keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
  """A problem with what the user asked for; the message names the argument and what is allowed."""
