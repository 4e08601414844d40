from pushsvc.cli import main

raise SystemExit(main())
