def target(:
    pass
