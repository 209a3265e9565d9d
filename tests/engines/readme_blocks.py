"""The README's plug-in code, read from the README itself: the fenced Python block after a
`<!-- tested: tests/engines/FILE::TEST -->` marker, so a test runs exactly what users copy."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def block(test_id):
    """The code of the Python block the README marks as tested by `test_id`
    ("test_sglang_0523.py::test_the_readme_plugin_code")."""
    with open(README) as f:
        text = f.read()
    marker = f"<!-- tested: tests/engines/{test_id} -->"
    at = text.index(marker)
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    if m is None:
        raise ValueError(f"README: no python block after {marker}")
    return m.group(1)
