"""Tiny random models of every family: hotneurons.common.tiny, under the name the tests import."""

from hotneurons.common.tiny import *  # noqa: F401,F403
