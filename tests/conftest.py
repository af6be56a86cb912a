import os
import sys

# Tests import the in-tree package and the helpers in tests/support/ (harness, peers, references).
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), os.path.join(HERE, "support")):
    if path not in sys.path:
        sys.path.insert(0, path)
