"""Print the requirements, of those named, that are not installed; exit 1 if any.

    python -m scripts.tools.check_deps pytest numpy 'mkdocs-material==9.*' 'setuptools>=77.0.3'

The Makefile installs what this prints, so the list it checks is the list it
installs (by distribution name, as pip spells it). Understands NAME, NAME==X.Y.Z,
NAME==X.* and NAME>=X.Y; compares release numbers only. Imports neither torch
nor anything else that is checked.
"""
import re
import sys
from importlib import metadata

SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(==|>=)\s*([0-9][0-9.]*)(\.\*)?)?$")


def release(version):
    """(9, 8, 2) from "9.8.2.post1" or "9.8.2rc1": the leading numbers."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def satisfied(requirement):
    match = SPEC.match(requirement.strip())
    if match is None:
        raise SystemExit(f"check_deps.py: cannot read the requirement {requirement!r}")
    name, op, wanted, star = match.groups()
    try:
        have = release(metadata.version(name))
    except metadata.PackageNotFoundError:
        return False
    if op is None:
        return True
    want = tuple(int(p) for p in wanted.rstrip(".").split("."))
    if op == ">=":
        return have >= want
    if star:  # ==X.*: the same leading numbers
        return have[:len(want)] == want
    return have + (0,) * (len(want) - len(have)) == want + (0,) * (len(have) - len(want))


def main(requirements):
    missing = [r for r in requirements if not satisfied(r)]
    print(" ".join(missing))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
