"""Tests of the judge's core (wacc/judge/), one file per module."""
