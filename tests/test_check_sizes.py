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


def test_a_new_violation_a_grown_one_and_a_stale_entry_fail(monkeypatch, capsys):
    monkeypatch.setattr(check_sizes, "allowed", lambda: {"a.py:f": 60, "gone.py": 600})
    monkeypatch.setattr(check_sizes, "sizes", lambda: {"a.py:f": 60, "gone.py": 600})
    assert check_sizes.main([]) == 0
    monkeypatch.setattr(check_sizes, "sizes", lambda: {"a.py:f": 61, "gone.py": 600, "b.py:g": 51})
    assert check_sizes.main([]) == 1
    out = capsys.readouterr().out
    assert "too long: a.py:f: 61 lines (limit 60)" in out and "too long: b.py:g: 51 lines (limit 50)" in out
    monkeypatch.setattr(check_sizes, "sizes", lambda: {"a.py:f": 60})
    assert check_sizes.main([]) == 1
    assert "no longer over the limit (remove it from size_allowlist.txt): gone.py" in capsys.readouterr().out
