"""Where studies live: results folders, study keys and Optuna storages (SQLite, journal, PostgreSQL) (`studies`),
the one adapter that holds every use of Optuna's private API (`optuna_api`), a fleet's claims and heartbeats
(`fleet`) and a disk's refusals (`faults`)."""
