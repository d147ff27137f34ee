"""Tests of the installable artefacts: packaging/deb/build.sh, lintian, dpkg install, upgrade and purge."""
