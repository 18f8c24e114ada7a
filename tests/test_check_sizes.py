"""The size checker (scripts/check_sizes.py): today's tree passes, a new long function fails."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import check_sizes  # noqa: E402


def test_tree_is_within_limits_or_allowed():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_sizes.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_long_function_and_method_are_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(50))
    source = f"def short():\n    pass\n\ndef long():\n{body}\n\nclass C:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    found = check_sizes.long_functions("f.py", check_sizes.ast.parse(source))
    assert found == {"f.py:long": 51, "f.py:C.m": 51}
