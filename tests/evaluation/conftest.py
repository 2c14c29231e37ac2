import sys
from pathlib import Path

# fake_engine.py sits next to the tests and is imported by name.
sys.path.insert(0, str(Path(__file__).parent))
