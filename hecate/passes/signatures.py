def report_unfused_signatures(gm, enabled, report):
    pass
