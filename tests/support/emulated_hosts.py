"""The gate of every test on emulated hosts (jaxodc.launch.cluster): where hosts cannot be made
here (not root, a tool missing) such a test is skipped, except under the test command, which
installs the tools and sets JAXODC_REQUIRE_HOSTS=1 (scripts/test.sh): there it fails, naming why,
so that CI never passes without having run them."""
import os

import pytest

from jaxodc.launch.cluster import unavailable

WHY = unavailable()
REQUIRED = os.environ.get("JAXODC_REQUIRE_HOSTS") == "1"

# Where required the test runs and fails on its own: Cluster raises ClusterUnavailable(WHY).
needs_hosts = pytest.mark.skipif(WHY is not None and not REQUIRED, reason=f"emulated hosts unavailable: {WHY}")


def require_hosts() -> None:
    """Skips (or, where required, fails) the calling test or fixture when hosts cannot be made."""
    if WHY is None:
        return
    if REQUIRED:
        pytest.fail(f"emulated hosts unavailable: {WHY} (JAXODC_REQUIRE_HOSTS=1)", pytrace=False)
    pytest.skip(f"emulated hosts unavailable: {WHY}")
