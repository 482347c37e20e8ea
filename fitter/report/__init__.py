"""`fitter report`: a tuning result, finished or still running, as tables (`tables`), figures (`figures`) and an
offline report.html (`page`), read without changing the study (`load`)."""

from __future__ import annotations

from fitter.report.load import ReportError, StudyResult, load_study_result
from fitter.report.page import Report, dashboard_command, write_report

__all__ = ["Report", "ReportError", "StudyResult", "dashboard_command", "load_study_result", "write_report"]
