import sys
from pathlib import Path

# Test helpers live beside the tests; the packages themselves are installed (pip install -e).
sys.path.insert(0, str(Path(__file__).parent))
