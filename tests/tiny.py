"""Tiny random models of every family: hotneurons.bench.tiny, under the name the tests import."""

from hotneurons.bench.tiny import *  # noqa: F403
