package dev.idempotency.client;

import org.junit.jupiter.api.extension.AfterAllCallback;
import org.junit.jupiter.api.extension.BeforeAllCallback;
import org.junit.jupiter.api.extension.ExtensionContext;

/**
 * One coordinator on SQLite for all the tests of a class, started before them and stopped after
 * them: {@code @RegisterExtension static final SharedCoordinator COORDINATOR = new
 * SharedCoordinator();} in the class, then {@link #get()} in its tests (and in its own
 * {@code @BeforeAll} methods, which run after the start).
 */
public final class SharedCoordinator implements BeforeAllCallback, AfterAllCallback {
  private Coordinator coordinator;

  @Override
  public void beforeAll(ExtensionContext context) {
    coordinator = Coordinator.start(Coordinator.Store.SQLITE);
  }

  @Override
  public void afterAll(ExtensionContext context) {
    if (coordinator != null) {
      coordinator.close();
      coordinator = null;
    }
  }

  /**
   * The class's coordinator.
   *
   * @return the coordinator, started
   */
  public Coordinator get() {
    if (coordinator == null) {
      throw new IllegalStateException("the coordinator runs only while the class's tests do");
    }
    return coordinator;
  }
}
