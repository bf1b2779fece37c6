"""What every Rudder process tells operators about itself, the same way in each: structured logs
(:mod:`.logs`), traces (:mod:`.traces`) and its build (:mod:`.build`). Entry points configure
them; library code only logs, opens spans and binds ids."""
