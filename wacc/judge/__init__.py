"""The judge's core: how an implementation under test is loaded and what it offers
(:mod:`~wacc.judge.implementation`, :mod:`~wacc.judge.contract`, :mod:`~wacc.judge.integrity`),
how a scenario runs on it (:mod:`~wacc.judge.runner`) and is judged against the reference
(:mod:`~wacc.judge.verdict`), how scenarios are searched and shrunk (:mod:`~wacc.judge.engine`,
:mod:`~wacc.judge.machine`, :mod:`~wacc.judge.shrink`, :mod:`~wacc.judge.profiles`) and when two
divergences are one finding (:mod:`~wacc.judge.signature`).

The commands (:mod:`wacc.commands`), the gate (:mod:`wacc.gate`), the report (:mod:`wacc.report`)
and the pytest plugin use it; it uses none of them. Importing this package imports nothing.
"""
