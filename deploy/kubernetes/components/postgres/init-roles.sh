#!/bin/sh
# Runs once, when the postgres container initialises its data folder (docker-entrypoint-initdb.d),
# as the image's superuser. Creates Rudder's two login roles with scram-sha-256 passwords read
# from the environment (psql \getenv: no password on a command line) and the database, owned by
# rudder_owner. The grants to rudder_app are made by the migrations (`rudder db upgrade`).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres <<'SQL'
SET password_encryption = 'scram-sha-256';
\getenv owner_pw RUDDER_DB_OWNER_PASSWORD
\getenv app_pw RUDDER_DB_APP_PASSWORD
CREATE ROLE rudder_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'owner_pw';
CREATE ROLE rudder_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'app_pw';
CREATE DATABASE rudder OWNER rudder_owner;
SQL
