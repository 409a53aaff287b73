from keel.cli import main

raise SystemExit(main())
