#!/bin/sh
echo "remote_coverage_tools is stubbed for offline builds: bazel coverage is unavailable" >&2
exit 1
