from gpuwatchd.cli.main import main

raise SystemExit(main())
